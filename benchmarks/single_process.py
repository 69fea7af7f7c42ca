"""Single-process training throughput and peak memory: full vs cola vs svd vs lax.

Each arch trains in its own fresh process (so peak memory is not polluted by the previous
arch) on the same random tokens; rounds are interleaved (full, cola, svd, lax, full, ...) so
machine noise hits every arch alike. Prints one table with ratios to ``full`` (or to the first
arch run). The model and step are the trainer's (``benchmarks/common.py``: BTP's grouped
block for low-rank archs unless ``--no-grouping``, clipping, fused AdamW), optionally under
bf16 autocast and ``torch.compile``.

    python benchmarks/single_process.py                 # 60M preset, seq 128, batch 4
    python benchmarks/single_process.py --preset 130M --device cuda --seq-len 1024
    python benchmarks/single_process.py --archs cola --mlp swiglu --batch-size 8 \
        --seq-len 256 --dtype bfloat16 --compile        # the issue-10 goal shape
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import resource
import statistics

ARCHS = ("full", "cola", "svd", "lax")


def _measure(arch: str, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    from common import Part, bench_config, random_batch

    from boostlr.models.counting import count_params, flops_per_token

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    extra = {
        "train.dtype": args.dtype,
        "train.compile": args.compile,
        "parallel.grouping": not args.no_grouping,
    }
    if args.mlp != "auto" and not (arch == "full" and args.mlp == "lowrank-only"):
        extra["model.mlp"] = args.mlp
    cfg = bench_config(args, arch, extra)
    baseline_rss = _peak_rss_mb()
    part = Part.build(cfg, device)
    inputs, targets = random_batch(args.vocab, args.batch_size, args.seq_len, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        seconds, loss = part.step(inputs, targets)
        if step >= args.warmup:
            times.append(seconds)
    step_time = statistics.median(times)
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = _peak_rss_mb() - baseline_rss
    tokens_per_step = args.batch_size * args.seq_len
    out.put(
        {
            "arch": arch,
            "params": count_params(cfg.model).total,
            "tokens_per_s": tokens_per_step / step_time,
            "step_time_s": step_time,
            "peak_mb": peak_mb,
            "flops_per_s": flops_per_token(cfg.model, args.seq_len) * tokens_per_step / step_time,
            "loss": float(loss),
        }
    )


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=None, help="default 1 (3 compiled)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions per arch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--mlp", default="auto", choices=("auto", "lowrank-only", "swiglu"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--compile", action="store_true", help="--train.compile true")
    parser.add_argument("--no-grouping", action="store_true", help="the ungrouped block")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = 3 if args.compile else 1

    ctx = mp.get_context("spawn")
    results: dict[str, list[dict]] = {arch: [] for arch in args.archs}
    for _ in range(args.rounds):
        for arch in args.archs:
            queue = ctx.Queue()
            proc = ctx.Process(target=_measure, args=(arch, args, queue))
            proc.start()
            results[arch].append(queue.get(timeout=1800))
            proc.join()

    from common import machine

    cpu = platform.processor() or platform.machine()
    print(machine())
    print(
        f"# single_process: preset {args.preset}, seq {args.seq_len}, batch {args.batch_size}, "
        f"vocab {args.vocab}, {args.steps} timed steps x {args.rounds} rounds, "
        f"device {args.device}, threads {args.threads}, {cpu}, {args.dtype}, mlp {args.mlp}, "
        f"{'compiled' if args.compile else 'eager'}, grouping {not args.no_grouping}"
    )
    best = {arch: max(rows, key=lambda r: r["tokens_per_s"]) for arch, rows in results.items()}
    ref = best[args.archs[0]]
    header = (
        f"{'arch':<6} {'params':>12} {'tokens/s':>10} {'step s':>8} {'GFLOP/s':>8} "
        f"{'peak MB':>9} {'tok/s vs ' + args.archs[0]:>14} {'mem vs ' + args.archs[0]:>12}"
    )
    print(header)
    print("-" * len(header))
    for arch in args.archs:
        r = best[arch]
        print(
            f"{arch:<6} {r['params']:>12,} {r['tokens_per_s']:>10,.0f} {r['step_time_s']:>8.3f} "
            f"{r['flops_per_s'] / 1e9:>8.1f} {r['peak_mb']:>9.0f} "
            f"{r['tokens_per_s'] / ref['tokens_per_s']:>13.2f}x "
            f"{r['peak_mb'] / ref['peak_mb']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
