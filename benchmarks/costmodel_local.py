"""The cost model against this machine: predicted vs measured step time at TP 2, three strategies.

Issue 8's goal: with the ``local`` profile (written by ``boostlr calibrate`` from measurements
on this machine), the predicted step times of ``full`` + ``megatron``, ``cola`` + ``vanilla``
and ``cola`` + ``btp`` at TP 2 on two gloo CPU ranks are within ±25% of measured. One launch
builds the three models (``ParallelModel``, the trainer's path: DTensor shards, fused
AdamW, the host allocator cache) and times them in interleaved rounds, so machine noise hits
all three alike. A step is
what the trainer times: zero_grad, forward + backward, gradient clipping, AdamW; the median
over ``--steps`` rounds after ``--warmup``, barrier to barrier (the slower rank's time, which
is what the model predicts). ``rank CPU s`` is the main thread's CPU time over the same step
(the busier rank), without time spent waiting on the peer or on other processes: wall far
above it on a quiet machine means waiting (communication, the other rank), on a busy one
that the cores were shared.

Each rank uses the profile's torch thread count (``[measurements] threads``), so the
prediction and the measurement see the same machine; the script warns when the two ranks
would share cores. Without a ``local`` profile it runs ``boostlr calibrate`` first (~20 s);
a profile from an older ``calibrate`` (no ``device = "cpu"``) is refused. Timings on a busy
machine are meaningless: run it alone, after ``boostlr calibrate`` on the same quiet machine.

What a first run on this (shared, loaded) 2-core VM showed the model was missing, and what
was changed in it, each from a measurement or from torch's own code, none fitted to this
benchmark:

* The optimizer step. The trainer then fused AdamW only in one process; over DTensor shards
  it ran torch's unfused AdamW (now fused there too): 8 passes, 84 bytes per parameter
  instead of one 28-byte pass,
  and on a CPU one dispatch per parameter tensor per pass (torch defaults to foreach only on
  GPUs). Gradient clipping (a norm and a scale, 12 bytes per parameter, and a scalar
  all-reduce per mesh dim) was not modelled at all. ``costmodel.optimizer_time``;
  ``tests/test_costmodel.py`` counts the passes in torch's implementation.
* Attention. CPU flash attention reaches about a third of the GEMM roofline (GPU kernels
  come close to it); ``calibrate`` now measures causal SDPA forward + backward and stores
  ``attention_efficiency`` (shipped GPU profiles: 1.0).
* Calibration under load. With one thread, ``calibrate`` times compute by the thread's CPU
  time, so a busy machine no longer makes the profile (and every prediction) slow.

Then (issue 8, second round) a rank's own CPU time was 2-2.7x the predicted compute and
optimizer. Counted in what torch dispatches (``analysis/census.py``) and measured:

* Element-wise traffic was an estimate at about half the real bytes (the backward was
  assumed to be twice the forward; it is 2-3x and includes gradient accumulation, the
  collectives' copies, BTP's concatenated weights): now ``gemms.block_elementwise``, forward
  and backward per strategy, within a few % of the census.
* Ops: a block dispatches 200-400 ops (kernels and views, forward and backward), not 120;
  each costs the CPU time ``calibrate`` measures per op of a tiny block of the model's own
  code (``gemms.BLOCK_OPS``, checked exactly against the census).
* DTensor: every parameter is unwrapped each forward and its gradient wrapped each backward
  (plus its share of clipping and AdamW's dispatch), ~0.1-0.3 ms each on this CPU; and each of
  boostlr's collectives costs host work beyond the transport (autograd function, ledger,
  profiler label). Both measured by ``calibrate`` on two processes.
* SiLU is compute-bound on a CPU core (an exp per element): its throughput is measured.
* GEMMs as a step runs them: the three layouts of a linear, operands from memory, training
  shapes (M = 512) in the sweep; element-wise efficiency from the model's RMSNorm.
* The two ranks share the machine: ``calibrate`` measures the compute constants in two
  processes at once (``--procs``), and what ranks in lockstep lose per collective beyond the
  transport (``sync_us``: the slower rank's lead, waking a blocked rank).

This VM's speed drifts (the same single-process op cost measured 4.9 us one hour and 9.4 us
the next): calibrate right before measuring (``--calibrate``), or the comparison mixes two
machines. ``rank CPU s`` shows how much of a gap is this rank's own work rather than
waiting.

    python benchmarks/costmodel_local.py [--calibrate] [--preset 60M] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import HardwareProfile, load_profile, user_dir
from boostlr.config import RunConfig, build_config, from_dict, to_dict
from boostlr.errors import ConfigError

STRATEGIES = [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")]
TP = 2


def config(args: argparse.Namespace, arch: str, strategy: str) -> RunConfig:
    overrides = {
        "model.preset": args.preset,
        "model.arch": arch,
        "data.seq_len": args.seq_len,
        "train.batch_size": args.batch_size,
        "train.dtype": "float32",
        "parallel.tp": TP,
        "parallel.tp_strategy": strategy,
        "parallel.act_ckpt": args.act_ckpt,
        "parallel.device": "cpu",
    }
    cfg = build_config(overrides=[(k, str(v)) for k, v in overrides.items()])
    cfg.model.vocab_size = args.vocab
    return cfg


def rank_entry(cfg_dicts: list[dict], threads: int, steps: int, warmup: int) -> dict:
    """Median seconds per step of each config, on this rank."""
    import torch.distributed as dist

    from boostlr.parallel.engine import ParallelModel
    from boostlr.parallel.launch import init_distributed
    from boostlr.train.host_alloc import keep_freed_host_memory
    from boostlr.train.optim import build_optimizer

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfgs = [from_dict(d) for d in cfg_dicts]
    device = torch.device("cpu")
    init_distributed(device, TP, pin_cores=True)  # as the trainer (parallel.pin_cores)
    torch.set_num_threads(threads)  # after init_distributed, which applies OMP_NUM_THREADS
    keep_freed_host_memory()  # as the trainer on CPU (train.cpu_alloc_cache, default on)
    runs = []
    for cfg in cfgs:
        model = ParallelModel.build(cfg, device)
        optimizer = build_optimizer(model.parameters(), cfg.train)  # fused, as the trainer
        runs.append((cfg, model, optimizer))
    gen = torch.Generator().manual_seed(0)
    b, s = cfgs[0].train.batch_size, cfgs[0].data.seq_len
    tokens = torch.randint(0, cfgs[0].model.vocab_size, (b, s + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step(
        cfg: RunConfig, model: ParallelModel, optimizer: torch.optim.Optimizer
    ) -> tuple[float, float]:
        dist.barrier()
        started, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        model.forward_backward(inputs, targets)
        model.clip_gradients(cfg.train.grad_clip)
        optimizer.step()
        cpu = time.thread_time() - cpu  # before the barrier: this rank's own work
        dist.barrier()
        return time.perf_counter() - started, cpu

    times: list[list[float]] = [[] for _ in runs]
    cpu: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + steps):
        for j, run in enumerate(runs):
            wall, busy = step(*run)
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
    try:
        hw = load_profile(name)
    except ConfigError:
        if name != "local":
            raise
        from boostlr.analysis.calibrate import calibrate

        print(f"no local profile in {user_dir()}: running boostlr calibrate --threads {threads}")
        path, _ = calibrate(threads=threads)
        print(f"wrote {path}")
        hw = load_profile("local")
    if hw.device != "cpu" or "block_ops_counted" not in hw.extra:
        raise SystemExit(
            f"profile {hw.name} ({hw.source or 'no source'}) is not a CPU profile written by "
            "this version of `boostlr calibrate` (per-op, DTensor, collective and lockstep "
            "costs not measured): run `boostlr calibrate` again (or pass --calibrate)"
        )
    return hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
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
        from boostlr.analysis.calibrate import calibrate

        path, _ = calibrate(threads=max(1, cores // TP))
        print(f"calibrated: wrote {path}")
    hw = local_profile(args.hardware, threads=max(1, cores // TP))
    threads = int(hw.extra.get("threads", 1))
    if TP * threads > cores:
        print(
            f"warning: {TP} ranks x {threads} threads (the profile's) on {cores} cores: the "
            "ranks compete for cores and the measurement is slower than the model"
        )
    cfgs = [config(args, arch, strategy) for arch, strategy in STRATEGIES]
    predicted = [predict(cfg, hw) for cfg in cfgs]
    measured = launch(TP, rank_entry, [to_dict(c) for c in cfgs], threads, args.steps, args.warmup)
    slowest = [max(r["median_s"][i] for r in measured.values()) for i in range(len(cfgs))]
    busiest = [max(r["cpu_s"][i] for r in measured.values()) for i in range(len(cfgs))]

    m = cfgs[1].model
    print(
        f"\n# costmodel_local: {args.preset} (d {m.dim}, {m.n_layers} layers, rank {m.rank}), "
        f"seq {args.seq_len}, batch {args.batch_size}, vocab {args.vocab}, fp32, act_ckpt "
        f"{args.act_ckpt}, TP {TP} on {TP} gloo ranks x {threads} thread(s), {cores} cores; "
        f"median of {args.steps} after {args.warmup} warm-up; profile: {hw.source}"
    )
    header = (
        f"{'strategy':<18}{'predicted s':>12}{'compute':>9}{'host':>8}{'tp comm':>9}{'optim':>8}"
        f"{'measured s':>12}{'pred/meas':>10}{'rank CPU s':>12}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for (arch, strategy), pred, meas, busy in zip(
        STRATEGIES, predicted, slowest, busiest, strict=True
    ):
        ratio = pred.step_time / meas
        worst = max(worst, abs(ratio - 1))
        parts = pred.parts
        print(
            f"{arch + ' + ' + strategy:<18}{pred.step_time:>12.4f}"
            f"{parts['gemm_elementwise_s'] + parts['recompute_s']:>9.4f}"
            f"{parts['host_s']:>8.4f}{parts['tp_comm_s']:>9.4f}{parts['optimizer_s']:>8.4f}"
            f"{meas:>12.4f}{ratio:>10.2f}{busy:>12.4f}"
        )
    order_p = sorted(range(3), key=lambda i: predicted[i].step_time)
    order_m = sorted(range(3), key=lambda i: slowest[i])
    print(
        f"largest |pred/meas - 1|: {worst:.0%} (goal: 25%); ordering "
        f"{'agrees' if order_p == order_m else 'differs'} (predicted "
        f"{' < '.join(STRATEGIES[i][1] for i in order_p)}, measured "
        f"{' < '.join(STRATEGIES[i][1] for i in order_m)})"
    )


if __name__ == "__main__":
    main()
