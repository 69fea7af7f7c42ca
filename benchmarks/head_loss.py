"""The fused LM head + cross-entropy against the unfused one: time and peak memory.

usage: ``python benchmarks/head_loss.py [--tokens 2048] [--dim 512] [--vocab 32000]``

Each variant (``unfused``: ``F.cross_entropy(F.linear(h, W).float())``; ``fused``:
:func:`boostlr.parallel.head_loss.head_cross_entropy`) runs forward + backward in its own
fresh process, in interleaved rounds, fp32 and bf16 autocast. Memory, measured first with
glibc's default allocator settings (large blocks returned on free): what one forward +
backward adds to the resident set at its peak (``VmHWM`` after resetting it through
``/proc/self/clear_refs``, minus ``VmRSS`` before; the gradients of ``h`` and ``W`` are
counted, the inputs are not). Time, then with the trainer's host allocator setting: the
median of the timed repetitions, then the median over rounds.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from boostlr.parallel.collectives import CommLedger, GroupComm
    from boostlr.parallel.head_loss import head_cross_entropy
    from boostlr.parallel.vocab import vocab_split
    from boostlr.train.host_alloc import keep_freed_host_memory

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=gen, requires_grad=True)
    w = (torch.randn(args.vocab, args.dim, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    comm = GroupComm(None, "tp", CommLedger())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step() -> None:
        h.grad = w.grad = None
        with autocast:
            if args.variant == "fused":
                loss = head_cross_entropy(h, w, targets, vocab_split(args.vocab, comm))
            else:
                loss = F.cross_entropy(F.linear(h, w).float(), targets)
        loss.backward()

    # Memory first, with glibc's defaults: blocks this large are mapped per allocation and
    # unmapped on free, so the high-water mark is what was alive at once.
    step()  # warm: imports, kernels
    h.grad = w.grad = None
    rss = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    step()
    peak_mb = (_status_kb("VmHWM") - rss) / 1024
    keep_freed_host_memory()  # then time as the trainer runs
    step()
    times = []
    for _ in range(args.reps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {"time_s": statistics.median(times), "peak_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="fused", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for dtype in args.dtypes:
            for variant in ("unfused", "fused"):
                cmd = [sys.executable, __file__, "--child", "--variant", variant]
                cmd += ["--dtype", dtype, "--tokens", str(args.tokens), "--dim", str(args.dim)]
                cmd += ["--vocab", str(args.vocab), "--threads", str(args.threads)]
                cmd += ["--reps", str(args.reps)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((dtype, variant), []).append(result)
                print(
                    f"round {round_index + 1}: {dtype:<8} {variant:<8} "
                    f"{result['time_s'] * 1e3:7.1f} ms  {result['peak_mb']:7.0f} MB"
                )
    print(
        f"\n# head_loss: {args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, "
        f"forward + backward, {args.threads} threads, {args.reps} reps x {args.rounds} rounds"
    )
    header = f"{'dtype':<9} {'variant':<8} {'ms':>7} {'peak MB':>8} {'time vs unfused':>16}"
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes:
        base = statistics.median(r["time_s"] for r in results[(dtype, "unfused")])
        for variant in ("unfused", "fused"):
            rows = results[(dtype, variant)]
            t = statistics.median(r["time_s"] for r in rows)
            mb = statistics.median(r["peak_mb"] for r in rows)
            print(f"{dtype:<9} {variant:<8} {t * 1e3:7.1f} {mb:8.0f} {base / t:15.2f}x")


if __name__ == "__main__":
    main()
