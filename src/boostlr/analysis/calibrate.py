"""``boostlr calibrate``: measure this machine (~25 s) and write the ``local`` profile.

* GEMM FLOP/s over shapes with one small dim and over a training step's shapes (M = 512
  tokens): the efficiency curve is fitted to them, never hand-set;
* memory bandwidth from a large copy; SiLU's throughput forward and backward (an exp per
  element: compute-bound on a CPU core);
* the CPU cost of one dispatched op of the model's own code: a tiny block (one device, the
  dense and the grouped low-rank one) forward + backward, whose kernels cost nothing at that
  size, divided by the ops it dispatches (counted by :mod:`boostlr.analysis.census`): Python,
  dispatch, autograd recording and the backward node;
* causal attention (forward + backward) as a fraction of the fitted GEMM roofline;
* between two real processes on this machine: all-reduce latency and bandwidth over gloo, what a
  DTensor parameter costs per micro-batch and per optimizer step beyond a plain one (a
  2-rank mesh, as a TP-2 run's), and the host work of one of boostlr's collectives beyond
  the transport (its autograd function, ledger record and profiler label).

Each process uses ``threads`` torch threads, as one rank of a local gloo run does; with one
thread the compute measurements are that thread's CPU time, so other jobs on a shared machine
do not slow the profile down (the all-reduce is wall time).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from boostlr.analysis.calibrate_link import (  # noqa: F401
    ALLREDUCE_BYTES,
    Clock,
    _allreduce_rank,
    _no_sync,
    _time,
    allreduce_reps,
    fit_allreduce,
    measure_allreduce,
)
from boostlr.analysis.hardware import GB, HardwareProfile, user_dir

GEMM_SHAPES = (
    [(1024, k, 1024) for k in (16, 32, 64, 128, 256, 512, 1024)]
    + [(m, 1024, 1024) for m in (16, 64, 256)]
    + [(1024, 1024, n) for n in (16, 64, 256)]
    + [(2048, 2048, 2048)]
    # A training step's: 512 tokens by a width and a (low) rank, both ways round.
    + [(512, k, 512) for k in (64, 128, 256, 512)]
    + [(512, 512, n) for n in (64, 128, 256)]
    + [(512, 1536, 512), (512, 512, 1536)]
)
SILU_ELEMENTS = 2**20
GEMM_POOL = 48 * 2**20  # bytes of operands a GEMM measurement cycles through (> L2)
ATTENTION_SHAPES = ((4, 8, 128, 64), (2, 8, 256, 64), (1, 8, 512, 64))  # batch, heads, seq, hd
AUTOGRAD_CHAIN = 64  # tiny ops per timed forward + backward


def _operands(m: int, k: int, n: int, a_t: bool, b_t: bool, dtype: torch.dtype):
    """``[m, k]`` and ``[k, n]`` operands, each stored transposed when asked."""
    a = torch.randn(k, m, dtype=dtype).t() if a_t else torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t() if b_t else torch.randn(k, n, dtype=dtype)
    return a, b


def measure_gemms(
    dtype: torch.dtype, shapes, clock: Clock = time.perf_counter, sync: Callable = _no_sync
) -> list[tuple[int, int, int, float]]:
    """Seconds per ``[m, k] @ [k, n]`` by shape, as a training step's linears run it.

    Each shape is timed in the three layouts a linear uses (forward ``x Wᵀ``, input grad
    ``g W``, weight grad ``gᵀ x``; the mean), its operands cycled through copies filling
    ``GEMM_POOL`` bytes: a step's operands come from memory, not from the last GEMM's cache.
    ``sync`` is called before each shape (processes measuring at once stay in step).
    """
    out = []
    for m, k, n in shapes:
        copies = max(1, GEMM_POOL // ((m * k + k * n) * torch.finfo(dtype).bits // 8))
        # (a, b) stored as a step has them: row-major a [m, k] and b [k, n], b transposed
        # (a weight [n, k]), a transposed (a gradient [k, m]).
        seconds = 0.0
        for a_t, b_t in ((False, False), (False, True), (True, False)):
            a, b = _operands(m, k, n, a_t, b_t, dtype)
            pairs = [(a, b)] + [(a.clone(), b.clone()) for _ in range(copies - 1)]
            turn = iter(range(10**9))

            def gemm(pairs=pairs, turn=turn) -> torch.Tensor:
                x, y = pairs[next(turn) % len(pairs)]
                return x @ y

            sync()
            seconds += _time(gemm, clock=clock) / 3
            del pairs, a, b
        out.append((m, k, n, seconds))
    return out


def _shape(m: float, k: float, n: float, h: float) -> float:
    return (m / (m + h)) * (k / (k + h)) * (n / (n + h))


def measure_bandwidth(clock: Clock = time.perf_counter) -> float:
    """Bytes/s of a 128 MB copy (read + write)."""
    big = torch.empty(32 * 2**20)
    dst = torch.empty_like(big)
    return 2 * big.numel() * 4 / _time(lambda: dst.copy_(big), budget=0.5, clock=clock)


def measure_elementwise(clock: Clock = time.perf_counter) -> tuple[float, float, int]:
    """(bytes, seconds, ops) of the model's most common element-wise work at a step's sizes:
    RMSNorm forward + backward on ``[512, 1024]`` activations cycled through ``GEMM_POOL``
    bytes, its bytes counted as the cost model counts them (``gemms.NORM``, fp32). The time
    includes the ops' dispatch (the caller takes ``ops`` launches out)."""
    from boostlr.analysis.gemms import NORM
    from boostlr.models.norm import rms_norm

    rows, width = 512, 1024
    xs = [torch.randn(rows, width) for _ in range(max(1, GEMM_POOL // (rows * width * 4)))]
    gain = torch.ones(width, requires_grad=True)
    seed = torch.ones(rows, width)
    turn = iter(range(10**9))

    def norm() -> None:
        x = xs[next(turn) % len(xs)].requires_grad_(True)
        rms_norm(x.view_as(x), gain, 1e-5).backward(seed)
        x.grad = None

    nbytes = (NORM[0] + NORM[1]) * rows * width * 4
    ops = 28  # what the census counts: 7 + 14 kernels, 7 views (view_as, detach, expand...)
    return nbytes, _time(norm, budget=0.3, clock=clock), ops


def measure_silu(clock: Clock = time.perf_counter) -> tuple[float, float]:
    """Elements/s of SiLU forward and of its backward (``silu_backward``), fp32."""
    x = torch.randn(SILU_ELEMENTS)
    g = torch.randn(SILU_ELEMENTS)
    fwd = _time(lambda: torch.nn.functional.silu(x), clock=clock)
    bwd = _time(lambda: torch.ops.aten.silu_backward(g, x), clock=clock)
    return SILU_ELEMENTS / fwd, SILU_ELEMENTS / bwd


def measure_op_cost(clock: Clock = time.perf_counter) -> tuple[float, int]:
    """(seconds per dispatched op, ops counted) of a tiny block's forward + backward.

    One device, the dense block and the grouped low-rank one (the code paths of every
    strategy's block), 8 tokens: the kernels cost nothing, what is left is the work of
    dispatching each op from the model's Python (autograd included).
    """
    from boostlr.analysis.census import OpCensus, census_backward
    from boostlr.config import build_config
    from boostlr.parallel.engine import ParallelModel

    total_s, total_ops = 0.0, 0
    for arch in ("full", "cola"):
        over = [("model.preset", "tiny"), ("model.arch", arch), ("model.n_layers", "1")]
        over += [("model.vocab_size", "64"), ("data.seq_len", "8"), ("train.batch_size", "1")]
        cfg = build_config(overrides=over)
        part = ParallelModel.build(cfg, torch.device("cpu")).stages[0]
        block = part.model.layers["0"]
        rope = rope_for(cfg)
        x = torch.randn(1, 8, cfg.model.dim, requires_grad=True)

        def step(block=block, part=part, rope=rope, x=x) -> None:
            y, _ = part._block_impl(block, x, rope, None)
            y.backward(torch.ones_like(y))

        census = OpCensus()
        step()
        with census:
            y, _ = part._block_impl(block, x, rope, None)
        census_backward(census, [y])
        total_ops += sum(census.ops.values())
        total_s += _time(step, budget=0.2, clock=clock)
    return total_s / total_ops, total_ops


def rope_for(cfg):
    from boostlr.models.llama import rope_tables

    return rope_tables(cfg.model, cfg.data.seq_len)


def measure_autograd_op(clock: Clock = time.perf_counter) -> float:
    """Seconds per op of a training step's tiny ops: forward under autograd plus backward."""
    x = torch.ones(8, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(AUTOGRAD_CHAIN):
            y = y * 1.0001
        y.sum().backward()

    return _time(chain, budget=0.2, clock=clock) / (2 * AUTOGRAD_CHAIN)


def measure_attention(
    shapes=ATTENTION_SHAPES, clock: Clock = time.perf_counter, sync: Callable = _no_sync
) -> list[tuple[tuple[int, ...], float]]:
    """Seconds of causal scaled-dot-product attention, forward + backward, by shape."""
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v) -> None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()

        sync()
        out.append(((b, h, s, d), _time(step, budget=0.3, clock=clock)))
    return out


def fit_attention(
    samples: list[tuple[tuple[int, ...], float]], peak: float, eff: float, half: float
) -> float:
    """The fraction of the GEMM roofline attention reaches (geometric mean over shapes).

    The model's attention work (``analysis/gemms.py``): two causal GEMMs forward, 2.5x that
    backward; only the compute term, the kernels being compute-bound at these sizes.
    """
    logs = []
    for (b, h, s, d), t in samples:
        roofline = 0.0
        for m, k, n in ((s, d, s), (s, s, d)):
            flops = 2 * m * k * n * b * h * 0.5 * 3.5  # causal half; forward + 2.5x backward
            roofline += flops / (peak * eff * _shape(m, k, n, half))
        logs.append(math.log(roofline / t))
    return math.exp(sum(logs) / len(logs))


def fit_gemm(
    samples: list[tuple[int, int, int, float]], bandwidth: float, launch: float, elem: int
) -> tuple[float, float, float]:
    """(peak FLOP/s, efficiency, half dim) minimising the squared log error of the roofline.

    ``peak`` is the best rate measured; efficiency and the half dim are found on a grid.
    """
    peak = max(2 * m * k * n / t for m, k, n, t in samples)
    best = (math.inf, 1.0, 1.0)
    for h in (2 ** (i / 8) for i in range(0, 81)):  # 1 .. 1024
        for eff in (0.5 + 0.02 * i for i in range(41)):  # 0.5 .. 1.3
            err = 0.0
            for m, k, n, t in samples:
                compute = 2 * m * k * n / (peak * eff * _shape(m, k, n, h))
                memory = (m * k + k * n + m * n) * elem / bandwidth
                err += (math.log(max(compute, memory) + launch) - math.log(t)) ** 2
            if err < best[0]:
                best = (err, eff, h)
    return peak, best[1], best[2]


def measure_compute(threads: int, sync: Callable = _no_sync) -> dict:
    """Everything a process measures on its own: op costs, bandwidth, σ, GEMMs, attention.

    ``sync`` is called before each measurement, so processes measuring at once run the same
    kind of work together (as a run's ranks do)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    # One thread: its CPU time, which other processes on a shared machine do not inflate
    # (what a rank gets on a quiet machine). More threads: wall time.
    clock: Clock = time.thread_time if threads == 1 else time.perf_counter
    try:
        tiny = torch.ones(8)
        sync()
        out: dict = {"bare": _time(lambda: torch.add(tiny, tiny), budget=0.1, clock=clock)}
        sync()
        out["autograd_op"] = measure_autograd_op(clock)
        sync()
        out["op_cost"], out["block_ops"] = measure_op_cost(clock)
        sync()
        out["silu"] = list(measure_silu(clock))
        sync()
        out["bandwidth"] = measure_bandwidth(clock)
        sync()
        out["elementwise"] = list(measure_elementwise(clock))
        out["fp32"] = measure_gemms(torch.float32, GEMM_SHAPES, clock, sync)
        bf16 = [(1024, 1024, 1024), (2048, 2048, 2048)]
        out["bf16"] = measure_gemms(torch.bfloat16, bf16, clock, sync)
        out["attention"] = measure_attention(clock=clock, sync=sync)
    finally:
        torch.set_num_threads(saved)
    return out


def _compute_rank(rank: int, threads: int, barrier, queue) -> None:
    try:
        # Every measurement starts together: each process sees the others doing the same.
        queue.put((rank, measure_compute(threads, sync=lambda: barrier.wait(timeout=300))))
    except BaseException as exc:
        queue.put((rank, RuntimeError(f"calibrate process {rank}: {type(exc).__name__}: {exc}")))
        raise


def _median(values: list):
    """Median of equal-shaped measurements: numbers, or lists whose last entry is a time."""
    first = values[0]
    if isinstance(first, (int, float)):
        return sorted(values)[len(values) // 2] if len(values) % 2 else sum(values) / len(values)
    if isinstance(first, tuple) and not isinstance(first[-1], (list, tuple)):  # (..., t)
        return (*first[:-1], _median([v[-1] for v in values]))
    return type(first)(_median(list(items)) for items in zip(*values, strict=True))


def measure_compute_concurrently(threads: int, procs: int) -> dict:
    """:func:`measure_compute` in ``procs`` processes at once (a local run's ranks share the
    machine's cores, caches and memory: each rank is slower than one process alone would
    be); every measurement is the median over the processes."""
    if procs <= 1:
        return measure_compute(threads)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_compute_rank, args=(r, threads, barrier, queue)) for r in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        results = [queue.get(timeout=600) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.terminate()
    for _, r in results:
        if isinstance(r, BaseException):
            raise r
    ms = [r for _, r in results]
    return {k: _median([m[k] for m in ms]) for k in ms[0]}


def default_procs(threads: int) -> int:
    """Processes measured at once: the two ranks of a local TP-2 run when the cores allow."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2, (cores or 1) // threads))


def calibrate(
    out: Path | None = None, threads: int = 1, procs: int | None = None
) -> tuple[Path, HardwareProfile]:
    """Measure this machine and write the ``local`` profile; ``procs`` processes measure the
    compute constants at once (default :func:`default_procs`), as a local run's ranks run."""
    procs = default_procs(threads) if procs is None else procs
    m = measure_compute_concurrently(threads, procs)
    bare, autograd_op, launch, block_ops = m["bare"], m["autograd_op"], m["op_cost"], m["block_ops"]
    silu_rate, silu_bwd_rate = m["silu"]
    bandwidth, fp32, bf16, attention = m["bandwidth"], m["fp32"], m["bf16"], m["attention"]
    # Element-wise efficiency: the norm's bytes over its time less its ops' dispatch, as a
    # fraction of the copy's bandwidth.
    ew_bytes, ew_seconds, ew_ops = m["elementwise"]
    kernels = max(ew_seconds - ew_ops * launch, 0.1 * ew_seconds)
    memory_eff = min(1.0, ew_bytes / kernels / bandwidth)
    peak, eff, half = fit_gemm(fp32, bandwidth, bare, 4)  # plain matmuls: the bare launch
    attention_eff = fit_attention(attention, peak, eff, half)
    # bf16: the fp32 efficiency curve, its own peak from the best bf16 rate.
    bf16_peak = max(2 * m * k * n / t / (eff * _shape(m, k, n, half)) for m, k, n, t in bf16)
    allreduce, (dtensor_param, dtensor_step), collective, sync_wait = measure_allreduce(threads)
    link = fit_allreduce(allreduce, launch)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = HardwareProfile(
        name="local",
        description=f"this machine's CPU, {threads} torch thread(s) per process, "
        f"{procs} process(es) at once, gloo",
        source="boostlr calibrate "
        + time.strftime("%Y-%m-%d %H:%M")
        + f", torch {torch.__version__}",
        memory=float(ram),
        gpus_per_node=os.cpu_count() or 1,
        peak_flops={"float32": peak, "bfloat16": bf16_peak},
        hbm_bandwidth=bandwidth,
        gemm_efficiency=eff,
        gemm_half_dim=half,
        memory_efficiency=memory_eff,
        launch=launch,
        attention_efficiency=attention_eff,
        device="cpu",
        host_op=launch,  # one core: a view costs what any op of the block costs
        dtensor_param=dtensor_param,
        dtensor_step=dtensor_step,
        collective_host=collective,
        sync_wait=sync_wait,
        silu_rate=silu_rate,
        silu_bwd_rate=silu_bwd_rate,
        intra=link,
        inter=link,
        extra={
            "threads": threads,
            "procs": procs,
            "gemm_float32_seconds": [[m, k, n, t] for m, k, n, t in fp32],
            "gemm_bfloat16_seconds": [[m, k, n, t] for m, k, n, t in bf16],
            "copy_gbps": bandwidth / GB,
            "rms_norm_fwd_bwd": [ew_bytes, ew_seconds, ew_ops],
            "bare_op_us": bare * 1e6,
            "autograd_op_us": autograd_op * 1e6,
            "block_ops_counted": block_ops,
            "attention_fwd_bwd_seconds": [[*shape, t] for shape, t in attention],
            "allreduce_2ranks_seconds": [[b, t] for b, t in allreduce],
        },
    )
    path = out or user_dir() / "local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Written by `boostlr calibrate` from measurements on this machine (see [measurements]),\n"
        f"# {procs} process(es) measuring at once (a local run's ranks share the machine):\n"
        "# peak = best fp32 GEMM rate; gemm_efficiency/gemm_half_dim fitted to the GEMM sweep;\n"
        "# hbm_gbps = a 128 MB copy; memory_efficiency = RMSNorm forward + backward's bytes\n"
        "# (as the cost model counts them) per second over it; silu_*gelems = SiLU throughput;\n"
        "# launch_us = [host] op_us = a tiny block's forward + backward per dispatched op;\n"
        "# attention_efficiency = causal SDPA forward + backward over the GEMM roofline;\n"
        "# links = 2-process gloo all-reduce (relative least squares); [host] dtensor_* = a\n"
        "# DTensor parameter beyond a plain one, collective_us = one boostlr collective's\n"
        "# host work beyond the transport, sync_us = what ranks in lockstep lose per\n"
        "# collective beyond the transport (all three on 2 processes).\n"
    )
    path.write_text(header + profile.to_toml())
    return path, profile
