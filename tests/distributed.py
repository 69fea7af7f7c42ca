"""Run a function on real gloo process groups from a pytest process.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, gives each
a gloo default group on a fresh localhost port, calls ``fn(rank, world_size, *args)``
and returns the per-rank results. The ranks are forked from one forkserver per pytest
process that has imported torch and boostlr's parallel stack once: a spawned rank would
pay those imports (seconds of CPU) on every call, and the suite makes hundreds of calls.
Each rank is still a fresh process with the caller's environment of the moment; still, put
many checks into one ``fn`` rather than one call per check.

A rank that raises (or dies) fails the call with that rank's traceback, and the other
ranks are terminated instead of being left blocked in a collective.

``BOOSTLR_TEST_BACKEND=nccl`` (``benchmarks/gpu_check.py`` on 2+ GPUs) gives the ranks NCCL
groups instead, each on its own GPU; tests that take their device from
:func:`rank_device` then run their collectives on the GPUs.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("BOOSTLR_TEST_BACKEND", "gloo")
# NCCL ranks must not be forked from a process that may have touched CUDA: spawn them.
START_METHOD = os.environ.get(
    "BOOSTLR_TEST_START_METHOD", "spawn" if BACKEND == "nccl" else "forkserver"
)

# Imported once by the forkserver, so that the ranks forked from it start with them loaded.
# Only imports: a forked rank must not inherit threads or a CUDA context from the server.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "boostlr.parallel.engine",
    "boostlr.train.run",
    "boostlr.models.llama",
    "boostlr.config",
    "parallel_cases",
]


def rank_device(rank: int) -> torch.device:
    """Where rank ``rank`` keeps its tensors: its GPU under NCCL, else the CPU."""
    if BACKEND == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class DistributedTestError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    # The forkserver's environment is the one it started with: take the caller's, as a
    # spawned rank would (tests set variables for their ranks), then what torch reads early.
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.set_debug_level_from_env()
    torch.set_num_threads(1)
    try:
        if BACKEND == "nccl":
            torch.cuda.set_device(rank_device(rank))
        dist.init_process_group(
            BACKEND,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Pickle here so an unpicklable result is reported, not lost in the queue thread.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = _free_port()
    # Children inherit the environment at start(), i.e. before they import torch.
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout_s, results, fn, args, dict(os.environ)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        if saved_omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved_omp

    out: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in order of arrival: the first is usually the cause
    deadline = time.monotonic() + timeout_s
    grace_end: float | None = None  # once a rank fails, the others get 1 s to report
    finished = False
    try:
        while len(out) + len(errors) < world_size:
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            if now > deadline:
                for r in range(world_size):
                    if r not in out and r not in errors:
                        errors[r] = f"did not finish within {timeout_s}s"
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                # A rank that exits without reporting was killed (signal, OOM, os._exit);
                # its exit code is set only after everything it queued was flushed.
                for r, p in enumerate(procs):
                    if r not in out and r not in errors and p.exitcode not in (None, 0):
                        if results.empty():
                            errors[r] = f"died with exit code {p.exitcode} without reporting"
            else:
                if ok:
                    out[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            if errors and grace_end is None:
                grace_end = time.monotonic() + 1.0
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors.items())
            raise DistributedTestError(f"{len(errors)} rank(s) failed:\n{report}")
        finished = True
    finally:
        for p in procs:
            p.join(timeout=5 if finished else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]
