"""MoE step time against the number of experts, at a fixed active shape: grouped vs the loop.

One process per measurement (the trainer's build and step, ``benchmarks/common.py``), a CoLA
MoE with latent dispatch, dropless, d 256, top-k 2, f_e 128, 2,048 tokens per step; only E
changes (8 and 64), so the work a token does is the same and an ideal implementation's step
time does not move. Two trees are measured side by side in one run: this checkout (``after``:
the experts as grouped GEMMs) and a git worktree of ``--baseline-ref`` (``before``: main's
per-expert loop). The four variants take turns in interleaved rounds, so the machine's load
hits them alike; the table reports each variant's median step and the E = 64 / E = 8 ratio
per tree (goal, issue 44: after <= 1.3).

    python benchmarks/moe_experts_scale.py                  # before = main
    python benchmarks/moe_experts_scale.py --baseline-ref 88b9a65 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXPERTS = (8, 64)


def _worker(args: argparse.Namespace) -> None:
    """Build the model at ``--experts`` and print the timed steps' seconds (JSON)."""
    import torch
    from common import Part, random_batch, run_config

    torch.set_num_threads(args.threads)
    cfg = run_config(
        {
            "model.preset": "tiny",
            "model.arch": "cola",
            "model.dim": args.dim,
            "model.ffn_dim": 4 * args.dim,
            "model.n_layers": args.layers,
            "model.vocab_size": args.vocab,
            "model.moe_experts": args.experts,
            "model.moe_top_k": 2,
            "model.moe_ffn_dim": args.ffn,
            "model.moe_dispatch": "latent",
            "data.seq_len": args.seq_len,
            "train.batch_size": args.batch_size,
            "train.dtype": args.dtype,
        }
    )
    device = torch.device("cpu")
    part = Part.build(cfg, device)
    inputs, targets = random_batch(args.vocab, args.batch_size, args.seq_len, device)
    times = []
    for step in range(args.warmup + args.steps):
        seconds, _ = part.step(inputs, targets)
        if step >= args.warmup:
            times.append(seconds)
    print(json.dumps({"times": times}))


def _measure(src: Path, experts: int, args: argparse.Namespace) -> list[float]:
    """One fresh process on the boostlr of ``src``: its timed steps' seconds."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--experts", str(experts)]
    for key in ("dim", "ffn", "layers", "vocab", "seq_len", "batch_size", "dtype", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"measurement failed ({src}, E {experts}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["times"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-ref", default="main", help="git ref of the 'before' tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128, help="f_e, each expert's inner width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--experts", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "before"
        add = ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base)]
        subprocess.run([*add, args.baseline_ref], check=True)
        try:
            trees = {"before": base / "src", "after": REPO / "src"}
            times: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.rounds):
                for tree, src in trees.items():
                    for experts in EXPERTS:
                        times.setdefault((tree, experts), []).extend(_measure(src, experts, args))
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False
            )
    _report(args, times)


def _report(args: argparse.Namespace, times: dict[tuple[str, int], list[float]]) -> None:
    import torch

    tokens = args.batch_size * args.seq_len
    print(
        f"# moe_experts_scale: cola latent dropless, d {args.dim}, {args.layers} MoE layers, "
        f"top_k 2, f_e {args.ffn}, {tokens} tokens/step, {args.dtype}, {args.threads} thread(s), "
        f"torch {torch.__version__}; before = {args.baseline_ref}, after = this checkout; "
        f"{args.rounds} rounds x {args.steps} timed steps per variant"
    )
    print(f"{'tree':8} {'E 8 step s':>11} {'E 64 step s':>12} {'E64 / E8':>9}")
    ratios = {}
    for tree in ("before", "after"):
        small, big = (statistics.median(times[(tree, e)]) for e in EXPERTS)
        ratios[tree] = big / small
        print(f"{tree:8} {small:11.4f} {big:12.4f} {ratios[tree]:9.2f}")
    for e in EXPERTS:
        before, after = (statistics.median(times[(t, e)]) for t in ("before", "after"))
        print(f"after / before at E {e}: {after / before:.2f}")
    met = "met" if ratios["after"] <= 1.3 else "NOT met"
    print(f"goal: step at E 64 <= 1.3x step at E 8 (after): {ratios['after']:.2f} ({met})")


if __name__ == "__main__":
    main()
