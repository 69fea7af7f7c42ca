"""``boostlr train`` variants side by side: step time and peak memory, interleaved rounds.

Each variant is a real ``boostlr train`` run in fresh processes (its own ranks), with its
own environment and, optionally, another source tree (``--before DIR``: a checkout of an
earlier commit, to measure a change against what it replaced). Rounds interleave the
variants so the machine's noise hits them alike; the table gives medians and ratios to the
first variant.

    python benchmarks/trainer_ab.py --allocators              # glibc / mallopt / jemalloc
    python benchmarks/trainer_ab.py --before /tmp/old-checkout --args --parallel.tp 2
    python benchmarks/trainer_ab.py --malloc-confs default dirty_decay_ms:0 --args --parallel.dp 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from boostlr.train.host_alloc import JEMALLOC_KEEP

SRC = Path(__file__).parents[1] / "src"


def run_once(variant: dict, args: argparse.Namespace) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="boostlr-ab-")) / "run"
    cmd = [sys.executable, "-m", "boostlr.cli", "train", "--run-dir", str(run_dir), "--quiet"]
    cmd += ["--model.preset", args.preset, "--data.seq_len", str(args.seq_len)]
    cmd += ["--train.batch_size", str(args.batch_size), "--train.steps", str(args.steps)]
    cmd += ["--train.log_every", "1", "--train.eval_every", "100000"]
    cmd += ["--train.ckpt_every", "100000", "--parallel.device", "cpu"]
    if args.data:
        cmd += ["--data.path", args.data]
    if args.vocab:
        cmd += ["--model.vocab_size", str(args.vocab)]
    cmd += [*args.args, *variant.get("args", [])]
    env = {**os.environ, **variant.get("env", {})}
    env["PYTHONPATH"] = str(variant.get("src", SRC))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{variant['label']} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    timed = [r["step_time_s"] for r in steps if r["step"] > args.warmup]
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return {"step_s": statistics.median(timed), "peak_mb": max(r["peak_mem_mb"] for r in steps)}


def variants(args: argparse.Namespace) -> list[dict]:
    if args.allocators:
        return [
            {"label": "mallopt (glibc heap kept)", "env": {"BOOSTLR_NO_ALLOCATOR_PRELOAD": "1"}},
            {"label": "glibc defaults", "args": ["--train.cpu_alloc_cache", "false"]},
            # jemalloc preloaded (the default); one process keeps its pages, ranks purge.
            {"label": "jemalloc, its own purging", "env": {"MALLOC_CONF": "dirty_decay_ms:10000"}},
            {"label": "jemalloc, pages kept", "env": {"MALLOC_CONF": JEMALLOC_KEEP}},
        ]
    if not args.before and not args.malloc_confs:
        sys.exit("give --allocators, --before DIR or --malloc-confs CONF ...")
    out = []
    if args.before:
        before = {"label": f"before ({args.before})", "src": Path(args.before) / "src"}
        before["args"] = shlex.split(args.before_args)
        out.append(before)
    if not args.malloc_confs:
        return [*out, {"label": "this tree"}]
    for conf in args.malloc_confs:
        env = {} if conf == "default" else {"MALLOC_CONF": conf}
        out.append({"label": f"this tree, MALLOC_CONF={conf}", "env": env})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--allocators", action="store_true")
    ap.add_argument("--before", default="", help="a checkout of an earlier commit")
    ap.add_argument(
        "--before-args", default="", help='extra args for it only, one string: "--parallel.x y"'
    )
    ap.add_argument(
        "--malloc-confs",
        nargs="+",
        default=[],
        help='this tree once per jemalloc MALLOC_CONF ("default": the launcher\'s choice)',
    )
    ap.add_argument("--preset", default="60M")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--data", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--args", nargs=argparse.REMAINDER, default=[], help="for every variant")
    args = ap.parse_args()
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    print(f"train: {args.preset}, batch {args.batch_size} x {args.seq_len}, {' '.join(args.args)}")
    vs = variants(args)
    results: dict[str, list[dict]] = {v["label"]: [] for v in vs}
    for _ in range(args.rounds):
        for v in vs:
            results[v["label"]].append(run_once(v, args))
    base = statistics.median(r["step_s"] for r in results[vs[0]["label"]])
    print("| variant | step s (median of rounds) | per round | ratio | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for v in vs:
        rs = results[v["label"]]
        step = statistics.median(r["step_s"] for r in rs)
        rounds = " / ".join(f"{r['step_s']:.3f}" for r in rs)
        peak = max(r["peak_mb"] for r in rs)
        print(f"| {v['label']} | {step:.3f} | {rounds} | {base / step:.2f}x | {peak:,.0f} |")


if __name__ == "__main__":
    main()
