"""``boostlr calibrate``'s measurements between two real processes, and the timing helpers.

The all-reduce latency and bandwidth over the backend, what a DTensor parameter costs
beyond a plain one, the host work of one of boostlr's collectives, and the wait a skewed
pair of ranks adds; :mod:`boostlr.analysis.calibrate` runs them beside its compute
measurements and writes the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from boostlr.analysis.hardware import Link

ALLREDUCE_BYTES = tuple(4**i * 4 * 2**10 for i in range(6))  # 4 KiB .. 4 MiB
DTENSOR_PARAMS = 64  # parameters per timed step of the DTensor measurement
COLLECTIVE_CALLS = 32
SYNC_SEGMENTS = 40
SYNC_REPEATS = 3  # the median of these

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


def allreduce_reps(nbytes: int) -> int:
    """Timed repetitions of one payload's all-reduce: the same on every rank (a collective
    must be called equally often everywhere), about 16 MiB moved, 5 to 50 calls."""
    return max(5, min(50, 2**24 // max(nbytes, 1)))


def _no_sync() -> None:
    pass


def _allreduce_rank(rank: int, world: int, port: int, threads: int, queue) -> None:
    try:
        _two_process_measurements(rank, world, port, threads, queue)
    except BaseException as exc:  # tell the parent now instead of letting it time out
        queue.put(RuntimeError(f"calibrate rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def _two_process_measurements(rank: int, world: int, port: int, threads: int, queue) -> None:
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
            # A time budget would let each rank pick its own count: mismatched collectives.
            results.append((nbytes, _time(op, budget=0.0, min_reps=allreduce_reps(nbytes))))
        clock: Clock = time.thread_time if threads == 1 else time.perf_counter
        dtensor = measure_dtensor(world, clock)
        collective = measure_collective_host(clock)
        sync = measure_sync_wait(results[0][1], clock)
        if rank == 0:
            queue.put((results, dtensor, collective, sync))
    finally:
        dist.destroy_process_group()


def measure_dtensor(world: int, clock: Clock) -> tuple[float, float]:
    """Seconds a DTensor parameter costs beyond a plain tensor: (per micro-batch, per step).

    Per micro-batch: the forward's ``to_local`` and the backward's wrapping of its gradient
    (and accumulating it into ``.grad``); per step: its share of gradient clipping (norm,
    scale) and of fused AdamW's dispatch. Every rank runs it (collective: the norm's
    ``full_tensor``), on a ``Shard(0)`` placement like most of a TP run's parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    n = DTENSOR_PARAMS

    def params(wrapped: bool) -> list[torch.nn.Parameter]:
        out = []
        for _ in range(n):
            t = torch.randn(16, 16)
            if wrapped:
                t = DTensor.from_local(
                    t, mesh, [Shard(0)], run_check=False, shape=(16 * world, 16), stride=(16, 1)
                )
            out.append(torch.nn.Parameter(t))
        return out

    def phases(ps: list[torch.nn.Parameter]) -> tuple[float, float]:
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        micro, step = [], []
        for i in range(25):
            opt.zero_grad(set_to_none=True)
            t0 = clock()
            total = sum((p.to_local() if isinstance(p, DTensor) else p).sum() for p in ps)
            total.backward()
            t1 = clock()
            norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(ps, 1.0, norm)
            opt.step()
            t2 = clock()
            if i >= 5:
                micro.append(t1 - t0)
                step.append(t2 - t1)
        return sorted(micro)[len(micro) // 2], sorted(step)[len(step) // 2]

    plain, wrapped = phases(params(False)), phases(params(True))
    return (
        max(0.0, (wrapped[0] - plain[0]) / n),
        max(0.0, (wrapped[1] - plain[1]) / n),
    )


def measure_sync_wait(allreduce_s: float, clock: Clock) -> float:
    """Seconds per collective that ranks in lockstep lose beyond the transport.

    Every rank runs the same few ms of work (two GEMMs and a SiLU on a step's sizes), then a
    small all-reduce, ``SYNC_SEGMENTS`` times, as a TP step alternates compute and
    collectives. Identical work does not take identical time on two processes, and a rank
    blocked in a collective must be woken and rescheduled (its core meanwhile runs the other
    processes' and gloo's threads): each collective costs more than back to back. Returns
    ``(wall - slowest rank's busy time) / segments - allreduce_s`` (the median of
    ``SYNC_REPEATS``); ``allreduce_s`` is the small all-reduce's own time (back to back).
    """
    x, w = torch.randn(512, 512), torch.randn(512, 512)
    tiny = torch.ones(1024)

    def segment() -> None:
        torch.nn.functional.silu(x @ w) @ w

    segment()
    waits = []
    for _ in range(SYNC_REPEATS):
        dist.barrier()
        busy = 0.0
        started = time.perf_counter()
        for _ in range(SYNC_SEGMENTS):
            t0 = clock()
            segment()
            busy += clock() - t0
            dist.all_reduce(tiny)
        wall = time.perf_counter() - started
        slowest = torch.tensor([busy])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        waits.append((wall - float(slowest)) / SYNC_SEGMENTS - allreduce_s)
    lost = sorted(waits)[len(waits) // 2]
    return max(0.0, lost)


def measure_collective_host(clock: Clock) -> float:
    """Host seconds of one of boostlr's collectives beyond the transport and its copy.

    ``copy_to_group`` then ``reduce_from_group`` forward and backward (one all-reduce each
    way) against the same payloads all-reduced directly; the difference per call is the
    autograd function, the ledger record and the profiler label.
    """
    from boostlr.parallel.collectives import (
        CommLedger,
        GroupComm,
        copy_to_group,
        reduce_from_group,
    )

    comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
    x = torch.randn(8, 16, requires_grad=True)
    seed = torch.ones(8, 16)

    def ours() -> None:
        y = reduce_from_group(copy_to_group(x, comm, "in") * 1.0, comm, "out")
        y.backward(seed)
        comm.ledger.reset()

    def bare() -> None:
        y = x * 1.0
        y.backward(seed)
        a, b = y.detach().clone(), y.detach().clone()
        dist.all_reduce(a, group=comm.group)
        dist.all_reduce(b, group=comm.group)

    reps = []
    for i in range(COLLECTIVE_CALLS):
        dist.barrier()
        t0 = clock()
        ours()
        t1 = clock()
        bare()
        t2 = clock()
        if i >= 4:
            reps.append(((t1 - t0) - (t2 - t1)) / 2)
    return max(0.0, sorted(reps)[len(reps) // 2])


def measure_allreduce(
    threads: int,
) -> tuple[list[tuple[int, float]], tuple[float, float], float, float]:
    """Between two local processes: gloo all-reduce times by payload, the DTensor parameter
    costs (:func:`measure_dtensor`), a collective's host work
    (:func:`measure_collective_host`) and the ranks' lockstep wait (:func:`measure_sync_wait`)."""
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
        results = queue.get(timeout=300)
        if isinstance(results, BaseException):
            errors = [str(results)]
            try:  # the other rank's error, usually the cause (this one lost its peer)
                errors.append(str(queue.get(timeout=5)))
            except Exception:
                pass
            raise RuntimeError("; ".join(reversed(errors)))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def _fit_line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """``t = c0 + c1 n`` minimising the squared *relative* error (every payload counts alike:
    a plain least-squares line is set by the largest payloads and any slow one)."""
    w = [1 / t**2 for _, t in samples]
    sw = sum(w)
    mx = sum(wi * n for wi, (n, _) in zip(w, samples, strict=True)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, samples, strict=True)) / sw
    sxx = sum(wi * (n - mx) ** 2 for wi, (n, _) in zip(w, samples, strict=True))
    sxy = sum(wi * (n - mx) * (t - my) for wi, (n, t) in zip(w, samples, strict=True))
    c1 = max(sxy / sxx, 1e-15)
    return max(my - c1 * mx, 0.0), c1


def fit_allreduce(samples: list[tuple[int, float]], launch: float) -> Link:
    """``t = c0 + c1 n`` (relative least squares; a payload more than 2x off the first fit is
    dropped once, a timing hit by the machine, not the link); a 2-rank ring is
    ``2(α + launch) + n / B``."""
    c0, c1 = _fit_line(samples)
    kept = [(n, t) for n, t in samples if 0.5 <= t / (c0 + c1 * n) <= 2.0]
    if 2 <= len(kept) < len(samples):
        c0, c1 = _fit_line(kept)
    return Link(bandwidth=1 / c1, latency=max(c0 / 2 - launch, 1e-7))
