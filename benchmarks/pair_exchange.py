"""Two gloo ranks: gloo's ring collectives against the pair exchange (``parallel.pair_exchange``).

usage: ``python benchmarks/pair_exchange.py [--rounds 3] [--steps 12] [--skip-train]``

1. Collectives: on two ranks of one host (pinned to their own cores, as the trainer pins
   them), the all-reduce payloads of BTP at the CoLA-60M shape (batch 8 x seq 256: latents of
   rank 128 with the norm statistic, ``[A_gate|A_up]``, ``[A_q|A_k|A_v]``) and the head's
   all-gather, through boostlr's own collectives with ``pair_exchange`` off and on,
   alternating call by call. Each call follows a GEMM (as in training, where a collective
   follows a region's compute); rank 0's median wall time per call and the ratio.
2. Trainer: ``boostlr train`` with BTP at T=2 (the speed issue's goal shape), runs with the
   option off and on in interleaved rounds; per run the median step time and the median share
   of a step rank 0 spent blocked in TP collectives (``comm_tp_time_s / step_time_s`` from
   metrics.jsonl, steps 3 on). The losses of the two variants must agree exactly.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKENS = 8 * 256
PAYLOADS = [  # (label, shape) of one rank's tensor
    ("latent r=128 + stat", (TOKENS, 129)),
    ("[A_gate|A_up] + stat", (TOKENS, 257)),
    ("[A_q|A_k|A_v] + stat", (TOKENS, 385)),
    ("all-gather d/2=256", (TOKENS, 256)),
]


def _collectives_rank(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist

    from boostlr.parallel.collectives import (
        CommLedger,
        GroupComm,
        gather_from_group,
        reduce_from_group,
    )
    from boostlr.parallel.launch import init_distributed

    init_distributed(torch.device("cpu"), 2, pin_cores=True)
    comms = {
        "gloo ring": GroupComm(dist.group.WORLD, "tp", CommLedger(), pair_exchange=False),
        "pair exchange": GroupComm(dist.group.WORLD, "tp", CommLedger()),
    }
    gen = torch.Generator().manual_seed(dist.get_rank())
    a, b = torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)
    times: dict[str, dict[str, list[float]]] = {}
    for label, shape in PAYLOADS:
        x = torch.randn(*shape, generator=gen)
        gather = label.startswith("all-gather")
        times[label] = {name: [] for name in comms}
        for i in range(2 * args.calls + 4):
            name = list(comms)[i % 2]
            a @ b  # a little compute between calls, as in a step
            started = time.perf_counter()
            if gather:
                gather_from_group(x, comms[name], "bench", dim=-1)
            else:
                reduce_from_group(x, comms[name], "bench")
            if i >= 4:  # the first two of each are warm-up
                times[label][name].append(time.perf_counter() - started)
    dist.destroy_process_group()
    return times


def bench_collectives(args: argparse.Namespace) -> None:
    from boostlr.parallel.launch import launch

    times = launch(2, _collectives_rank, args)[0]
    print(f"\n# pair_exchange: collectives, 2 gloo ranks, {args.calls} calls each, rank 0 median")
    print(f"{'payload':<24} {'MB':>6} {'gloo ring ms':>13} {'exchange ms':>12} {'ratio':>7}")
    for label, shape in PAYLOADS:
        ring = statistics.median(times[label]["gloo ring"]) * 1e3
        pair = statistics.median(times[label]["pair exchange"]) * 1e3
        mb = shape[0] * shape[1] * 4 / 1e6
        print(f"{label:<24} {mb:>6.2f} {ring:>13.2f} {pair:>12.2f} {ring / pair:>6.2f}x")


def _train(run_dir: Path, pair: bool, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "boostlr.cli", "train",
        "--model.preset", args.preset, "--model.arch", "cola", "--model.mlp", "swiglu",
        "--data.seq_len", str(args.seq_len), "--train.batch_size", str(args.batch_size),
        "--train.steps", str(args.steps), "--train.log_every", "1", "--train.eval_every", "1000",
        "--parallel.tp", "2", "--parallel.tp_strategy", "btp",
        "--parallel.pair_exchange", str(pair).lower(),
        "--run-dir", str(run_dir), "--quiet",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "comm_tp_time_s" in r]
    timed = [r for r in rows if r["step"] >= 3]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "share": statistics.median(r["comm_tp_time_s"] / r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in rows],
    }


def bench_trainer(args: argparse.Namespace) -> None:
    print(
        f"\n# pair_exchange: boostlr train, CoLA-{args.preset} SwiGLU, batch {args.batch_size} x "
        f"seq {args.seq_len}, BTP T=2, "
        f"{args.steps} steps (3 on timed), {args.rounds} interleaved rounds"
    )
    print(f"{'round':<6} {'variant':<14} {'step s':>8} {'comm share':>11}")
    results: dict[str, list[dict]] = {"gloo ring": [], "pair exchange": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = [False, True] if rnd % 2 == 0 else [True, False]
            for pair in order:
                name = "pair exchange" if pair else "gloo ring"
                res = _train(Path(tmp) / f"{name.replace(' ', '_')}{rnd}", pair, args)
                results[name].append(res)
                print(f"{rnd:<6} {name:<14} {res['step_s']:>8.3f} {res['share']:>11.3f}")
    ring, pair = results["gloo ring"], results["pair exchange"]
    same = all(r["losses"] == p["losses"] for r, p in zip(ring, pair, strict=True))
    step_ring = statistics.median(r["step_s"] for r in ring)
    step_pair = statistics.median(r["step_s"] for r in pair)
    print(
        f"median over runs: step {step_ring:.3f} s -> {step_pair:.3f} s "
        f"({step_ring / step_pair:.2f}x), exposed TP comm share "
        f"{statistics.median(r['share'] for r in ring):.3f} -> "
        f"{statistics.median(r['share'] for r in pair):.3f}; "
        f"losses identical: {'yes' if same else 'NO'}"
    )
    if not same:
        raise SystemExit("the two variants' losses differ: pair exchange changed the math")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per payload/variant")
    parser.add_argument("--rounds", type=int, default=3, help="trainer rounds (one run each)")
    parser.add_argument("--steps", type=int, default=12, help="trainer steps per run")
    parser.add_argument("--skip-train", action="store_true", help="collectives only")
    parser.add_argument("--preset", default="60M", help="trainer model preset")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}")
    bench_collectives(args)
    if not args.skip_train:
        bench_trainer(args)


if __name__ == "__main__":
    main()
