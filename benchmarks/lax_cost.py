"""What LaX costs beyond CoLA at TP 2 on CPU, measured and as the cost model predicts it.

Two gloo ranks time CoLA and LaX under BTP and vanilla TP in interleaved rounds (machine
noise hits all alike) and print the LaX/CoLA step-time ratio per strategy beside the cost
model's ratio at the same shape (``--hardware``, default the ``local`` profile that
``boostlr calibrate`` writes; it is calibrated first when missing). Then rank 0 profiles one
step of each and prints where LaX's extra CPU time goes, by aten op: the crossing's gate
GEMMs, its ``LN_r``, σ, the adds, and (vanilla) the latents' gathers.

    python benchmarks/lax_cost.py [--preset 60M] [--seq-len 256] [--batch-size 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics

import torch
from common import bench_config, load_or_calibrate

from boostlr.analysis.costmodel import predict
from boostlr.config import RunConfig, from_dict, to_dict

CASES = [("cola", "btp"), ("lax", "btp"), ("cola", "vanilla"), ("lax", "vanilla")]
TP = 2


def config(args: argparse.Namespace, arch: str, strategy: str) -> RunConfig:
    extra = {"train.dtype": "float32", "parallel.tp": TP, "parallel.tp_strategy": strategy}
    return bench_config(args, arch, extra)


def _rank(cfg_dicts: list[dict], threads: int, rounds: int, steps: int) -> dict:
    import torch.distributed as dist
    from common import Part, random_batch, timed_step
    from torch.profiler import ProfilerActivity, profile

    from boostlr.parallel.launch import init_distributed

    cfgs = [from_dict(d) for d in cfg_dicts]
    device = torch.device("cpu")
    init_distributed(device, TP, pin_cores=True)
    torch.set_num_threads(threads)
    parts = [Part.build(cfg, device) for cfg in cfgs]
    inputs, targets = random_batch(
        cfgs[0].model.vocab_size, cfgs[0].train.batch_size, cfgs[0].data.seq_len, device
    )

    for part in parts:  # warm-up
        timed_step(part, inputs, targets)
    times: list[list[float]] = [[] for _ in parts]
    cpus: list[list[float]] = [[] for _ in parts]
    for _ in range(rounds):
        for i, part in enumerate(parts):
            for _ in range(steps):
                wall, cpu = timed_step(part, inputs, targets)
                times[i].append(wall)
                cpus[i].append(cpu)
    by_op = []
    for part in parts:  # where the time goes, by aten op (this rank's CPU time)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed_step(part, inputs, targets)
        ops: collections.Counter = collections.Counter()
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                ops[e.key] += e.self_cpu_time_total / 1e6
        by_op.append(dict(ops))
    dist.destroy_process_group()
    return {
        "median_s": [statistics.median(t) for t in times],
        "cpu_s": [statistics.median(t) for t in cpus],
        "by_op": by_op,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--hardware", default="local", help="profile name or .toml path")
    args = parser.parse_args()

    from boostlr.parallel.launch import launch

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // TP)
    hw = load_or_calibrate(args.hardware, threads)
    cfgs = [config(args, a, s) for a, s in CASES]
    preds = [predict(c, hw) for c in cfgs]
    predicted = [p.step_time for p in preds]
    res = launch(TP, _rank, [to_dict(c) for c in cfgs], threads, args.rounds, args.steps)
    measured = [max(r["median_s"][i] for r in res.values()) for i in range(len(cfgs))]
    busy = [max(r["cpu_s"][i] for r in res.values()) for i in range(len(cfgs))]
    m = cfgs[1].model
    print(
        f"\n# lax_cost: {args.preset} (d {m.dim}, {m.n_layers} layers, rank {m.rank}, gate rank "
        f"{m.lax_gate_rank}), seq {args.seq_len}, batch {args.batch_size}, vocab {args.vocab}, "
        f"fp32, TP {TP} gloo ranks x {threads} thread(s) on {cores} cores, {platform.machine()}; "
        f"{args.rounds} rounds x {args.steps} steps, interleaved; profile {hw.name} ({hw.source})"
    )
    print(
        "LaX/CoLA step time: measured wall (slowest rank's median), measured rank CPU time "
        "(this rank's own work), the model's step and its compute (no TP comm)"
    )
    print(
        f"{'strategy':<10}{'cola s':>9}{'lax s':>9}{'wall':>8}{'cpu':>8}{'model':>8}"
        f"{'compute':>9}{'model/wall':>12}{'model/cpu':>11}"
    )
    for k, strategy in enumerate(("btp", "vanilla")):
        i, j = 2 * k, 2 * k + 1
        wall, cpu = measured[j] / measured[i], busy[j] / busy[i]
        pred = predicted[j] / predicted[i]
        comp = preds[j].compute / preds[i].compute
        print(
            f"{strategy:<10}{measured[i]:>9.3f}{measured[j]:>9.3f}{wall:>8.3f}{cpu:>8.3f}"
            f"{pred:>8.3f}{comp:>9.3f}{pred / wall:>12.3f}{comp / cpu:>11.3f}"
        )
        parts = {
            key: preds[j].parts[key] - preds[i].parts[key]
            for key in ("gemm_elementwise_s", "tp_comm_s", "optimizer_s")
        }
        print("  model's LaX extra, s: " + ", ".join(f"{k} {v:+.4f}" for k, v in parts.items()))
    by_op = res[0]["by_op"]
    for k, strategy in enumerate(("btp", "vanilla")):
        cola, lax = by_op[2 * k], by_op[2 * k + 1]
        extra = {op: lax.get(op, 0.0) - cola.get(op, 0.0) for op in set(cola) | set(lax)}
        total = sum(lax.values()) - sum(cola.values())
        top = sorted(extra.items(), key=lambda kv: -kv[1])[:8]
        print(f"\nLaX - CoLA, {strategy}, rank 0 CPU s by aten op (total {total:+.3f} s):")
        for op, sec in top:
            print(f"  {op:<40}{sec:+.4f}")


if __name__ == "__main__":
    main()
