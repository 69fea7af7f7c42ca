"""The cost model against this machine: step-time ratios between strategies at TP 2 on CPU.

The cost model plans GPUs: it charges kernels, bytes, collectives and the host's dispatch
per aten op (the ``local`` profile's ``host_op_us``, measured on the trainer's own step). On a
CPU host and kernels share the cores, so absolute predictions are not its job; what it should
get right is how the strategies compare. With
the ``local`` profile (``boostlr calibrate`` on this machine), the predicted step times of
``full`` + ``megatron``, ``cola`` + ``vanilla`` and ``cola`` + ``btp`` at TP 2 on two gloo CPU
ranks are divided by BTP's, and so are the measured ones; the script prints both ratios and
their agreement, at each ``--batch-sizes`` micro-batch size (default 1, 2, 4, 8 sequences:
the fixed per-step costs' share grows as the micro-batch shrinks, issue 47). One launch builds
the models (``ParallelModel``, the trainer's path) and times them in interleaved rounds, so
machine noise hits all of them alike. A step is what
the trainer times: zero_grad, forward + backward, gradient clipping, AdamW; the median over
``--steps`` rounds after ``--warmup``, barrier to barrier (the slower rank's time). ``rank
CPU s`` is the main thread's CPU time over the same step (the busier rank).

Each rank uses the profile's torch thread count (``[measurements] threads``). Without a
``local`` profile it runs ``boostlr calibrate`` first (about a minute); ``--calibrate`` recalibrates
first, for a machine whose speed drifts.

    python benchmarks/costmodel_local.py [--calibrate] [--preset 60M] [--seq-len 128] \
        [--batch-sizes 1,2,4,8]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics

import torch
from common import bench_config, load_or_calibrate

from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import HardwareProfile
from boostlr.config import RunConfig, from_dict, to_dict

STRATEGIES = [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")]
TP = 2


def config(args: argparse.Namespace, arch: str, strategy: str, batch: int) -> RunConfig:
    args = argparse.Namespace(**{**vars(args), "batch_size": batch})
    extra = {
        "train.dtype": "float32",
        "parallel.tp": TP,
        "parallel.tp_strategy": strategy,
        "parallel.act_ckpt": args.act_ckpt,
    }
    return bench_config(args, arch, extra)


def rank_entry(cfg_dicts: list[dict], threads: int, steps: int, warmup: int) -> dict:
    """Median seconds per step of each config, on this rank."""
    import torch.distributed as dist
    from common import Part, random_batch, timed_step

    from boostlr.parallel.launch import init_distributed
    from boostlr.train.host_alloc import keep_freed_host_memory

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfgs = [from_dict(d) for d in cfg_dicts]
    device = torch.device("cpu")
    init_distributed(device, TP, pin_cores=True)  # as the trainer (parallel.pin_cores)
    torch.set_num_threads(threads)  # after init_distributed, which applies OMP_NUM_THREADS
    keep_freed_host_memory()  # as the trainer on CPU (train.cpu_alloc_cache, default on)
    parts = [Part.build(cfg, device) for cfg in cfgs]
    batches = [
        random_batch(c.model.vocab_size, c.train.batch_size, c.data.seq_len, device) for c in cfgs
    ]

    times: list[list[float]] = [[] for _ in parts]
    cpu: list[list[float]] = [[] for _ in parts]
    for i in range(warmup + steps):
        for j, (part, (inputs, targets)) in enumerate(zip(parts, batches, strict=True)):
            wall, busy = timed_step(part, inputs, targets)
            if i >= warmup:
                times[j].append(wall)
                cpu[j].append(busy)
    dist.destroy_process_group()
    return {
        "median_s": [statistics.median(ts) for ts in times],
        "cpu_s": [statistics.median(ts) for ts in cpu],
    }


def local_profile(name: str, threads: int) -> HardwareProfile:
    """The profile to predict with; ``local`` is calibrated first when it does not exist."""
    hw = load_or_calibrate(name, threads)
    if hw.device != "cpu":
        raise SystemExit(
            f"profile {hw.name} ({hw.source or 'no source'}) is not a CPU profile: run "
            "`boostlr calibrate` on this machine (or pass --calibrate)"
        )
    return hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--batch-sizes", default="1,2,4,8", help="sequences per micro-batch, comma-separated"
    )
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--act-ckpt", default="none", choices=["none", "block"])
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--hardware", default="local", help="profile name or .toml path")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="run `boostlr calibrate` first (rewrites the local profile): the prediction and "
        "the measurement then see the machine in the same state",
    )
    args = parser.parse_args()

    from boostlr.parallel.launch import launch

    cores = len(os.sched_getaffinity(0))
    if args.calibrate:
        from boostlr.calibrate import calibrate

        path, _ = calibrate(threads=max(1, cores // TP))
        print(f"calibrated: wrote {path}")
    hw = local_profile(args.hardware, threads=max(1, cores // TP))
    threads = int(hw.extra.get("threads", 1))
    if TP * threads > cores:
        print(
            f"warning: {TP} ranks x {threads} threads (the profile's) on {cores} cores: the "
            "ranks compete for cores and the measurement is slower than the model"
        )
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    cfgs = [config(args, a, s, b) for b in sizes for a, s in STRATEGIES]
    predicted = [predict(cfg, hw) for cfg in cfgs]
    measured = launch(TP, rank_entry, [to_dict(c) for c in cfgs], threads, args.steps, args.warmup)
    slowest = [max(r["median_s"][i] for r in measured.values()) for i in range(len(cfgs))]
    busiest = [max(r["cpu_s"][i] for r in measured.values()) for i in range(len(cfgs))]

    m = cfgs[1].model
    print(
        f"\n# costmodel_local: {args.preset} (d {m.dim}, {m.n_layers} layers, rank {m.rank}), "
        f"seq {args.seq_len}, micro-batches {sizes}, vocab {args.vocab}, fp32, act_ckpt "
        f"{args.act_ckpt}, TP {TP} on {TP} gloo ranks x {threads} thread(s), {cores} cores; "
        f"median of {args.steps} after {args.warmup} warm-up; load {os.getloadavg()[0]:.1f}; "
        f"profile: {hw.source}"
    )
    header = (
        f"{'mb':>3} {'strategy':<18}{'predicted s':>12}{'measured s':>12}{'rank CPU s':>12}"
        f"{'pred / btp':>12}{'meas / btp':>12}{'agreement':>11}{'CPU / btp':>11}"
        f"{'agr. CPU':>10}{'fixed %':>9}"
    )
    print(header)
    print("-" * len(header))
    btp = STRATEGIES.index(("cola", "btp"))
    worst = worst_cpu = 0.0
    n = len(STRATEGIES)
    for g, batch in enumerate(sizes):
        pred, meas = predicted[g * n : (g + 1) * n], slowest[g * n : (g + 1) * n]
        cpu = busiest[g * n : (g + 1) * n]
        for i, (arch, strategy) in enumerate(STRATEGIES):
            rp, rm = pred[i].step_time / pred[btp].step_time, meas[i] / meas[btp]
            rc = cpu[i] / cpu[btp]
            if i != btp:
                worst = max(worst, abs(rp / rm - 1))
                worst_cpu = max(worst_cpu, abs(rp / rc - 1))
            print(
                f"{batch:>3} {arch + ' + ' + strategy:<18}{pred[i].step_time:>12.4f}"
                f"{meas[i]:>12.4f}{cpu[i]:>12.4f}{rp:>12.2f}{rm:>12.2f}{rp / rm:>11.2f}"
                f"{rc:>11.2f}{rp / rc:>10.2f}{100 * pred[i].fixed['fixed_share']:>9.0f}"
            )
    # On a machine shared with other work the wall time carries everyone's load; the rank's
    # own CPU time does not (it misses only the waits in collectives).
    print(
        f"largest |ratio pred / ratio meas - 1| over every micro-batch size: {worst:.0%} "
        f"(wall), {worst_cpu:.0%} (rank CPU time)"
    )


if __name__ == "__main__":
    main()
