"""boostlr's one-process training step against the public CoLA reference implementation.

The reference is https://github.com/alvin-zyl/CoLA (Hugging Face LLaMA with CoLA layers). It
is never vendored: check it out anywhere and give this script a Python that can import it
(its code needs transformers 4.53; later versions break its imports)::

    git clone https://github.com/alvin-zyl/CoLA /tmp/cola-ref
    python -m venv /tmp/cola-venv
    /tmp/cola-venv/bin/pip install torch==2.13.0 "transformers==4.53.*"
    python benchmarks/vs_reference.py --ref-repo /tmp/cola-ref \
        --ref-python /tmp/cola-venv/bin/python

Both sides train the reference's 60M config (dim 512, 8 layers, 8 heads, ffn 1376, rank 128,
vocabulary 32000, CoLA in every projection plus the SwiGLU activation) on the same random
tokens, batch 8 x seq 256, with the same step: forward and loss, backward, clip the gradient
norm, AdamW, zero the gradients. The reference's step is its ``main.py`` loop (default
``torch.optim.AdamW``, ``clip_grad_norm_``); boostlr's is its trainer's (fused AdamW, its
clipping, its host-allocator setting ``train.cpu_alloc_cache``). bf16 means autocast on both.

Every measurement runs in a fresh process and the rounds are interleaved (ref, boostlr, ...)
so machine noise hits all alike. boostlr's children run under the host allocator its trainer
uses on CPU (jemalloc preloaded, pages kept, when installed; else glibc's heap kept through the
``MALLOC_*_`` tunables); ``ref+alloc`` runs the reference under the same, which separates what
the framework's allocator setting buys from what its kernels buy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(batch=8, seq=256, vocab=32000)
GLIBC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def _time_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def child_reference(args: argparse.Namespace) -> dict:
    """Runs under the reference's Python: its model, its optimizer, its clipping."""
    import torch

    sys.path.insert(0, args.ref_repo)
    from cola import ColaConfig, ColaForCausalLM  # the reference repo's package

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ColaConfig.from_json_file(str(Path(args.ref_repo) / "cola_configs/cola_60m.json"))
    model = ColaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = _tokens(torch)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step() -> None:
        with autocast:
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"times": _time_steps(step, args.warmup, args.steps)}


def child_boostlr(args: argparse.Namespace) -> dict:
    """The trainer's one-device step on the same shape (``benchmarks/common.py``)."""
    import torch
    from common import Part, run_config

    from boostlr.train.host_alloc import cache_host_memory

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the trainer on CPU
    cache_host_memory()  # mallopt only if no jemalloc was preloaded (see _trainer_allocator)
    cfg = run_config(
        {
            "model.preset": "60M",
            "model.arch": "cola",
            "model.mlp": "swiglu",
            "model.vocab_size": SHAPE["vocab"],
            "data.seq_len": SHAPE["seq"],
            "train.batch_size": SHAPE["batch"],
            "train.grad_clip": 0.5,
            "train.weight_decay": 0.01,
            "train.dtype": args.dtype,
            "train.compile": args.compile,
            "train.fused_loss": not args.unfused_loss,
            "parallel.device": "cpu",
            "parallel.grouping": not args.no_grouping,
        }
    )
    part = Part.build(cfg, torch.device("cpu"))
    tokens = _tokens(torch)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        part.step(inputs, targets)

    return {"times": _time_steps(step, args.warmup + (2 if args.compile else 0), args.steps)}


def _tokens(torch):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"] + 1), generator=gen)


def _trainer_allocator() -> dict[str, str]:
    """The host allocator a one-process ``boostlr train`` runs under (train.cpu_alloc_cache):
    jemalloc preloaded with its pages kept when installed, else glibc told to keep its heap."""
    from boostlr.train.host_alloc import allocator_env

    return allocator_env(True, "cpu") or GLIBC_KEEP


def _run_child(variant: str, dtype: str, args: argparse.Namespace) -> float:
    """Median step time of one fresh process."""
    compiled = variant == "boostlr+compile"
    python = args.ref_python if variant.startswith("ref") else sys.executable
    cmd = [python, __file__, "--child", "ref" if variant.startswith("ref") else "boostlr"]
    cmd += ["--dtype", dtype, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--threads", str(args.threads), "--ref-repo", args.ref_repo]
    cmd += ["--compile"] if compiled else []
    cmd += ["--no-grouping"] if args.no_grouping else []
    cmd += ["--unfused-loss"] if variant == "boostlr-unfused" else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if variant == "ref+alloc" or variant.startswith("boostlr"):
        env.update(_trainer_allocator())
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{variant} {dtype} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(result["times"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-repo", required=True, help="a checkout of alvin-zyl/CoLA")
    parser.add_argument("--ref-python", default=sys.executable, help="Python with its deps")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip boostlr+compile (bf16)")
    parser.add_argument("--no-grouping", action="store_true", help="boostlr's ungrouped block")
    parser.add_argument(
        "--with-unfused",
        action="store_true",
        help="also boostlr with train.fused_loss off (boostlr-unfused)",
    )
    parser.add_argument("--unfused-loss", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("ref", "boostlr"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child_reference(args) if args.child == "ref" else child_boostlr(args)
        print(json.dumps(result))
        return
    if not (Path(args.ref_repo) / "cola" / "modeling_cola.py").is_file():
        raise SystemExit(f"--ref-repo {args.ref_repo} is not a checkout of alvin-zyl/CoLA")

    variants = {
        dtype: ["ref", "ref+alloc", "boostlr"]
        + (["boostlr-unfused"] if args.with_unfused else [])
        + (["boostlr+compile"] if dtype == "bfloat16" and not args.no_compile else [])
        for dtype in args.dtypes
    }
    times: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for dtype, names in variants.items():
            for name in names:
                step = _run_child(name, dtype, args)
                times.setdefault((dtype, name), []).append(step)
                print(f"round {round_index + 1}: {dtype:<8} {name:<16} {step:.3f} s/step")

    tokens = SHAPE["batch"] * SHAPE["seq"]
    print(
        f"\n# vs_reference: CoLA-60M (reference config), batch {SHAPE['batch']} x seq "
        f"{SHAPE['seq']}, vocab {SHAPE['vocab']}, {args.threads} threads, {args.steps} timed "
        f"steps x {args.rounds} interleaved rounds, {platform.processor() or platform.machine()}"
    )
    header = f"{'dtype':<9} {'variant':<16} {'tokens/s':>9} {'step s':>7} {'vs ref':>7}"
    print(header)
    print("-" * len(header))
    for dtype, names in variants.items():
        ref = statistics.median(times[(dtype, "ref")])
        for name in names:
            step = statistics.median(times[(dtype, name)])
            print(f"{dtype:<9} {name:<16} {tokens / step:>9,.0f} {step:>7.3f} {ref / step:>6.2f}x")


if __name__ == "__main__":
    main()
