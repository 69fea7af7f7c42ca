"""``boostlr calibrate``: measure the device at hand and write the ``local`` profile.

It measures what a profile holds, on CUDA when a GPU is visible (else on this CPU):

* GEMM time over shapes with one small dim and over a training step's shapes: the peak, the
  large-GEMM efficiency and the dim that halves it are fitted to them, never hand-set;
* memory bandwidth (a large copy), the element-wise fraction of it (an eager add), and the
  fixed cost of one small kernel (launch and dispatch);
* causal attention (forward + backward) as a fraction of the fitted GEMM roofline;
* the host's CPU time per dispatched aten op of the trainer's own step (a tiny CoLA model,
  at TP 2 on two processes where two fit: what a tensor-parallel rank's host pays per op);
* the link: all-reduce latency and bandwidth between two processes (NCCL on two GPUs, gloo
  on the CPU; one GPU alone keeps the link of ``--like``, default ``h100-sxm``, and says so).

The cost model reads nothing else, so nothing else is measured. This module sits beside the
cost model (``boostlr.analysis``), not in it: planning is arithmetic on shapes, while this runs
kernels on a device and spawns processes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from boostlr.analysis.hardware import GB, HardwareProfile, Link, load_profile, user_dir
from boostlr.config import RunConfig, build_config
from boostlr.host_ops import host_seconds_per_op, trainer_step
from boostlr.platform import platform_for, resolve_device

GEMM_SHAPES = (
    [(2048, k, 2048) for k in (32, 64, 128, 256, 512, 1024, 2048)]
    + [(m, 2048, 2048) for m in (32, 128, 512)]
    + [(2048, 2048, n) for n in (32, 128, 512)]
    + [(4096, 4096, 4096)]
)
CPU_GEMM_SHAPES = [(m // 4, k // 4, n // 4) for m, k, n in GEMM_SHAPES]
ATTENTION_SHAPES = ((1, 8, 1024, 64), (1, 8, 2048, 128))  # batch, heads, seq, head dim
ALLREDUCE_BYTES = tuple(4**i * 64 * 2**10 for i in range(6))  # 64 KiB .. 64 MiB


def _time(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    """Median seconds of ``fn`` after a warm-up (CUDA: synchronised around each call)."""
    sync = platform_for(device).synchronize
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_gemms(shapes, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """Seconds per ``[m, k] @ [k, n]`` by shape."""
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        out.append((m, k, n, _time(lambda a=a, b=b: a @ b, device)))
    return out


def _shape(m: float, k: float, n: float, h: float) -> float:
    return (m / (m + h)) * (k / (k + h)) * (n / (n + h))


def fit_gemm(samples: list[tuple], bandwidth: float, launch: float, elem: int) -> tuple:
    """(peak FLOP/s, efficiency, half dim) minimising the squared log error of the roofline;
    ``peak`` is the best rate measured, efficiency and the half dim found on a grid."""
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


def measure_memory(device: torch.device) -> tuple[float, float, float]:
    """(copy bytes/s, element-wise fraction of it, seconds per small kernel of a training
    step: its forward under autograd and its backward, so dispatch counts as on a step)."""
    n = 8 * 2**20 if platform_for(device).is_host else 64 * 2**20
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    dst = torch.empty_like(a)
    copy = 2 * n * 4 / _time(lambda: dst.copy_(a), device)
    add = 3 * n * 4 / _time(lambda: torch.add(a, b, out=dst), device)
    tiny = torch.ones(8, device=device, requires_grad=True)
    chain = 64

    def small() -> None:  # as a training step's ops run: recorded forward, then backward
        y = tiny
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return copy, min(1.0, add / copy), _time(small, device) / (2 * chain)


def fit_attention(samples: list[tuple], peak: float, eff: float, half: float) -> float:
    """The fraction of the GEMM roofline attention reaches (geometric mean over shapes): the
    model's attention is two causal GEMMs forward and 2.5x that backward."""
    logs = []
    for (b, h, s, d), t in samples:
        roofline = sum(
            2 * m * k * n * b * h * 0.5 * 3.5 / (peak * eff * _shape(m, k, n, half))
            for m, k, n in ((s, d, s), (s, s, d))
        )
        logs.append(math.log(roofline / t))
    return math.exp(sum(logs) / len(logs))


def measure_attention(dtype: torch.dtype, device: torch.device) -> list[tuple]:
    out = []
    for b, h, s, d in ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(True)

        def step(q=q, k=k, v=v) -> None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()

        out.append(((b, h, s, d), _time(step, device, reps=5)))
    return out


def _allreduce_samples(device: torch.device) -> list[tuple[int, float]]:
    """All-reduce seconds by payload on this rank (same count on each)."""
    import torch.distributed as dist

    samples = []
    for nbytes in ALLREDUCE_BYTES:
        x = torch.ones(nbytes // 4, device=device)
        dist.barrier()
        samples.append((nbytes, _time(lambda x=x: dist.all_reduce(x), device)))
    return samples


def host_op_config(tp: int, cuda: bool) -> RunConfig:
    """The step :func:`measure_host_op` times: a tiny CoLA model (its kernels take next to
    no time, so the step is the host's), at ``tp`` with the strategy ``auto`` picks, in the
    dtype a run on this device trains in."""
    return build_config(
        overrides=[
            ("model.preset", "tiny"),
            ("model.arch", "cola"),
            ("model.vocab_size", "512"),
            ("data.seq_len", "8"),
            ("train.batch_size", "1"),
            ("train.dtype", "bfloat16" if cuda else "float32"),
            ("parallel.tp", str(tp)),
        ]
    )


def _host_op_sample(device: torch.device) -> tuple[float, int]:
    """(host seconds per dispatched op, ops per step) of the trainer's step on this rank."""
    import torch.distributed as dist

    tp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = host_op_config(tp, not platform_for(device).is_host)
    return host_seconds_per_op(trainer_step(cfg, device))


PAIR_JOBS: dict[str, Callable[[torch.device], object]] = {
    "allreduce": _allreduce_samples,
    "host_op": _host_op_sample,
}


def _pair_rank(rank: int, port: int, kind: str, job: str, threads: int, queue) -> None:
    import torch.distributed as dist

    try:
        platform = platform_for(kind)
        device = platform.claim(rank)
        torch.set_num_threads(threads)
        dist.init_process_group(
            platform.backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=120),
        )
        result = PAIR_JOBS[job](device)
        if rank == 0:
            queue.put(result)
        dist.destroy_process_group()
    except BaseException as exc:  # tell the parent now instead of letting it time out
        queue.put(RuntimeError(f"calibrate rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def _on_two_processes(device: torch.device, job: str, threads: int = 1):
    """Rank 0's result of ``PAIR_JOBS[job]`` run by two local processes (``threads``
    torch threads each)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_pair_rank, args=(r, port, device.type, job, threads, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if isinstance(result, BaseException):
        raise result
    return result


def measure_allreduce(device: torch.device) -> list[tuple[int, float]]:
    """All-reduce seconds by payload between two local processes (same count on each)."""
    return _on_two_processes(device, "allreduce")


def measure_host_op(device: torch.device, pair: bool, threads: int = 1) -> tuple[float, int]:
    """(host seconds per dispatched aten op, ops per step) of the trainer's own step.

    ``pair``: on two processes at TP 2, as a tensor-parallel rank dispatches (distributed
    parameters and collectives cost the host more per op than one process's plain model);
    else in this process."""
    if pair:
        return _on_two_processes(device, "host_op", threads)
    return _host_op_sample(device)


def fit_allreduce(samples: list[tuple[int, float]], launch: float) -> Link:
    """``t = c0 + c1 n`` by relative least squares (each payload counts alike); a 2-rank
    ring is ``2(α + launch) + n / B``."""
    w = [1 / t**2 for _, t in samples]
    sw = sum(w)
    mx = sum(wi * n for wi, (n, _) in zip(w, samples, strict=True)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, samples, strict=True)) / sw
    sxx = sum(wi * (n - mx) ** 2 for wi, (n, _) in zip(w, samples, strict=True))
    sxy = sum(wi * (n - mx) * (t - my) for wi, (n, t) in zip(w, samples, strict=True))
    c1 = max(sxy / sxx, 1e-15)
    c0 = max(my - c1 * mx, 0.0)
    return Link(bandwidth=1 / c1, latency=max(c0 / 2 - launch, 1e-7))


def calibrate(
    out: Path | None = None, threads: int = 1, like: str = "h100-sxm"
) -> tuple[Path, HardwareProfile]:
    """Measure the device at hand and write the ``local`` profile (``threads``: torch
    threads on a CPU, as one rank of a local run uses)."""
    device = resolve_device("auto")
    platform = platform_for(device)
    cuda = not platform.is_host
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth, mem_eff, launch = measure_memory(device)
        shapes = GEMM_SHAPES if cuda else CPU_GEMM_SHAPES
        dtype = torch.bfloat16 if cuda else torch.float32
        gemms = measure_gemms(shapes, dtype, device)
        peak, eff, half = fit_gemm(gemms, bandwidth, launch, 2 if cuda else 4)
        other = torch.float32 if cuda else torch.bfloat16
        big = measure_gemms([shapes[-1]], other, device)
        other_peak = max(2 * m * k * n / t / (eff * _shape(m, k, n, half)) for m, k, n, t in big)
        attention = measure_attention(dtype, device)
        host_op, host_ops = measure_host_op(device, platform.can_pair(), torch.get_num_threads())
    finally:
        torch.set_num_threads(saved)
    attention_eff = fit_attention(attention, peak, eff, half)
    if platform.can_pair():
        samples = measure_allreduce(device)
        link, link_source = fit_allreduce(samples, launch), "2-process all-reduce"
    else:
        samples, template = [], load_profile(like)
        link, link_source = template.intra, f"not measured (one GPU): {like}'s"
    name, memory, per_node = platform.describe(device)
    peaks = (
        {"bfloat16": peak, "float32": other_peak}
        if cuda
        else {"float32": peak, "bfloat16": other_peak}
    )
    profile = HardwareProfile(
        name="local",
        description=f"{name}, measured by boostlr calibrate ({threads} torch thread(s) on a CPU)",
        source=f"boostlr calibrate {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}",
        memory=memory,
        gpus_per_node=per_node,
        peak_flops=peaks,
        hbm_bandwidth=bandwidth,
        gemm_efficiency=eff,
        gemm_half_dim=half,
        memory_efficiency=mem_eff,
        launch=launch,
        host_op=host_op,
        attention_efficiency=attention_eff,
        device="gpu" if cuda else "cpu",
        intra=link,
        inter=link,
        extra={
            "threads": threads,
            "link": link_source,
            "gemm_seconds": [[m, k, n, t] for m, k, n, t in gemms],
            "copy_gbps": bandwidth / GB,
            "attention_fwd_bwd_seconds": [[*shape, t] for shape, t in attention],
            "allreduce_2ranks_seconds": [[b, t] for b, t in samples],
            "host_ops_per_step": host_ops,
            "host_op_ranks": 2 if platform.can_pair() else 1,
        },
    )
    path = out or user_dir() / "local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Written by `boostlr calibrate` from measurements on this device (see [measurements]):\n"
        "# peak = best GEMM rate; gemm_efficiency/gemm_half_dim fitted to the GEMM sweep;\n"
        "# hbm_gbps = a large copy; memory_efficiency = an eager add's bandwidth over it;\n"
        "# launch_us = a small op's forward + backward under autograd, per kernel;\n"
        "# host_op_us = the host's CPU time per dispatched aten op of a tiny CoLA model's\n"
        "#   trainer step (TP 2 on two processes where two fit, else one);\n"
        "# attention_efficiency = causal SDPA forward + backward over the GEMM roofline;\n"
        f"# links = {link_source}.\n"
    )
    path.write_text(header + profile.to_toml())
    return path, profile
