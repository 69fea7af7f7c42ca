"""``boostlr calibrate``: measure this machine (~20 s) and write the ``local`` profile.

GEMM FLOP/s over shapes with one small dim (the efficiency curve is fitted to them, never
hand-set), memory bandwidth from a large copy, the per-op cost of a training step's ops (a
chain of tiny ops run forward and backward under autograd: dispatch, autograd recording and
the backward node, not the bare kernel), causal attention (forward + backward) as a fraction
of the fitted GEMM roofline, and the all-reduce latency and bandwidth of gloo between two real
processes on this machine. Each process uses ``threads`` torch threads, as one rank of a local
gloo run does; with one thread the compute measurements are that thread's CPU time, so other
jobs on a shared machine do not slow the profile down (the all-reduce is wall time).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from boostlr.analysis.hardware import GB, HardwareProfile, Link, user_dir

GEMM_SHAPES = (
    [(1024, k, 1024) for k in (16, 32, 64, 128, 256, 512, 1024)]
    + [(m, 1024, 1024) for m in (16, 64, 256)]
    + [(1024, 1024, n) for n in (16, 64, 256)]
    + [(2048, 2048, 2048)]
)
ALLREDUCE_BYTES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20)
ATTENTION_SHAPES = ((4, 8, 128, 64), (2, 8, 256, 64), (1, 8, 512, 64))  # batch, heads, seq, hd
AUTOGRAD_CHAIN = 64  # tiny ops per timed forward + backward


Clock = Callable[[], float]


def _time(fn, budget: float = 0.15, min_reps: int = 3, clock: Clock = time.perf_counter) -> float:
    """Median seconds of ``fn`` by ``clock`` (after one warm-up) within ~``budget`` seconds."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) > 200:
            break
    return sorted(times)[len(times) // 2]


def measure_gemms(
    dtype: torch.dtype, shapes, clock: Clock = time.perf_counter
) -> list[tuple[int, int, int, float]]:
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out.append((m, k, n, _time(lambda a=a, b=b: a @ b, clock=clock)))
    return out


def _shape(m: float, k: float, n: float, h: float) -> float:
    return (m / (m + h)) * (k / (k + h)) * (n / (n + h))


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
    shapes=ATTENTION_SHAPES, clock: Clock = time.perf_counter
) -> list[tuple[tuple[int, ...], float]]:
    """Seconds of causal scaled-dot-product attention, forward + backward, by shape."""
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v) -> None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()

        out.append(((b, h, s, d), _time(step, budget=0.2, clock=clock)))
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


def _allreduce_rank(rank: int, world: int, port: int, threads: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        results = []
        for nbytes in ALLREDUCE_BYTES:
            x = torch.ones(nbytes // 4)

            def op(x=x) -> None:
                dist.all_reduce(x)

            dist.barrier()
            results.append((nbytes, _time(op, budget=0.4, min_reps=5)))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_allreduce(threads: int) -> list[tuple[int, float]]:
    """gloo all-reduce times between two local processes, by payload."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, 2, port, threads, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def fit_allreduce(samples: list[tuple[int, float]], launch: float) -> Link:
    """Least squares ``t = c0 + c1 n``; a 2-rank ring is ``2(α + launch) + n / B``."""
    n = len(samples)
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    c0 = my - c1 * mx
    return Link(bandwidth=1 / max(c1, 1e-15), latency=max(c0 / 2 - launch, 1e-7))


def calibrate(out: Path | None = None, threads: int = 1) -> tuple[Path, HardwareProfile]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    # One thread: its CPU time, which other processes on a shared machine do not inflate
    # (what a rank gets on a quiet machine). More threads: wall time.
    clock: Clock = time.thread_time if threads == 1 else time.perf_counter
    try:
        tiny = torch.ones(8)
        bare = _time(lambda: torch.add(tiny, tiny), budget=0.1, clock=clock)
        launch = measure_autograd_op(clock)
        big = torch.empty(32 * 2**20)  # 128 MB
        dst = torch.empty_like(big)
        copy = _time(lambda: dst.copy_(big), budget=0.5, clock=clock)
        bandwidth = 2 * big.numel() * 4 / copy
        fp32 = measure_gemms(torch.float32, GEMM_SHAPES, clock)
        bf16 = measure_gemms(torch.bfloat16, [(1024, 1024, 1024), (2048, 2048, 2048)], clock)
        attention = measure_attention(clock=clock)
    finally:
        torch.set_num_threads(saved)
    peak, eff, half = fit_gemm(fp32, bandwidth, bare, 4)  # plain matmuls: the bare launch
    attention_eff = fit_attention(attention, peak, eff, half)
    # bf16: the fp32 efficiency curve, its own peak from the best bf16 rate.
    bf16_peak = max(2 * m * k * n / t / (eff * _shape(m, k, n, half)) for m, k, n, t in bf16)
    allreduce = measure_allreduce(threads)
    link = fit_allreduce(allreduce, launch)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = HardwareProfile(
        name="local",
        description=f"this machine's CPU, {threads} torch thread(s) per process, gloo",
        source="boostlr calibrate "
        + time.strftime("%Y-%m-%d %H:%M")
        + f", torch {torch.__version__}",
        memory=float(ram),
        gpus_per_node=os.cpu_count() or 1,
        peak_flops={"float32": peak, "bfloat16": bf16_peak},
        hbm_bandwidth=bandwidth,
        gemm_efficiency=eff,
        gemm_half_dim=half,
        memory_efficiency=1.0,
        launch=launch,
        attention_efficiency=attention_eff,
        device="cpu",
        intra=link,
        inter=link,
        extra={
            "threads": threads,
            "gemm_float32_seconds": [[m, k, n, t] for m, k, n, t in fp32],
            "gemm_bfloat16_seconds": [[m, k, n, t] for m, k, n, t in bf16],
            "copy_gbps": bandwidth / GB,
            "bare_op_us": bare * 1e6,
            "attention_fwd_bwd_seconds": [[*shape, t] for shape, t in attention],
            "allreduce_2ranks_seconds": [[b, t] for b, t in allreduce],
        },
    )
    path = out or user_dir() / "local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Written by `boostlr calibrate` from measurements on this machine (see [measurements]):\n"
        "# peak = best fp32 GEMM rate; gemm_efficiency/gemm_half_dim fitted to the GEMM sweep;\n"
        "# hbm_gbps = a 128 MB copy; launch_us = a tiny op forward + backward under autograd;\n"
        "# attention_efficiency = causal SDPA forward + backward over the GEMM roofline;\n"
        "# links = 2-process gloo all-reduce.\n"
    )
    path.write_text(header + profile.to_toml())
    return path, profile
