"""``boostlr plan --trace``: the real trainer, one rank of each role, in a fake world.

Each traced rank runs in a fresh process (``spawn``): a fake process group of the run's world
size, the run's mesh, ``ParallelModel``'s build under fake tensors, then two training steps
on a batch of the config's shape (:func:`boostlr.trace.rank.two_steps`; at most two
micro-batches run per step, the ledger repeating the second for the rest). Nothing
is allocated and nothing is sent, so a paper-size rank fits in a laptop's memory. The
ranks' processes are independent: they run side by side, one per core by default.

The ranks traced are one per distinct role: every pipeline rank (each holds its own stages)
at ``dp = tp = 0``, plus the last ``(dp, tp)`` rank of a pipeline rank holding the embedding
or the head when the vocabulary does not split evenly (its rows, and so its memory and
traffic, differ from rank 0's).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from typing import Any

from boostlr.analysis.costmodel import planning_config
from boostlr.config import RunConfig, vocab_over_dp
from boostlr.errors import BoostlrError
from boostlr.trace.rank import MICRO_TRACED, RankTrace, coordinates

TIMEOUT_S = 600  # one rank's trace; the paper's largest layouts take a few minutes


def traced_ranks(cfg: RunConfig) -> list[int]:
    """Global ranks, one per role (pipeline rank; uneven vocabulary edges)."""
    p = cfg.parallel
    per_stage = p.dp * p.tp
    ranks = [pp * per_stage for pp in range(p.pp)]
    split = p.tp * (p.dp if p.dp > 1 and vocab_over_dp(cfg) and not cfg.model.tie_embeddings else 1)
    if split > 1 and cfg.model.vocab_size % split:
        for pp in sorted({0, p.pp - 1}):
            ranks.append(pp * per_stage + per_stage - 1)
    return sorted(set(ranks))


def trace_here(cfg: RunConfig, rank: int, micro_limit: int | None = MICRO_TRACED) -> RankTrace:
    """Trace ``rank`` in this process: a fake world, its mesh, the build and two steps
    (an MoE model under balanced routing: :mod:`boostlr.trace.moe_routing`).

    ``micro_limit``: micro-batches run per step (None: all ``grad_accum``). The process
    must have no default process group; it has none again afterwards.
    """
    import torch.distributed as dist

    from boostlr.trace.counter import StorageCounter, counting
    from boostlr.trace.fake_world import fake_tensors, init_fake_world
    from boostlr.trace.moe_routing import balanced_routing
    from boostlr.trace.rank import mesh_on_default_group, two_steps

    init_fake_world(rank, cfg.parallel.world_size)
    try:
        comms = mesh_on_default_group(cfg)  # real rank tables, before the fake mode
        with fake_tensors() as mode, balanced_routing(cfg):
            counter = StorageCounter(mode)
            with counting(counter):
                return two_steps(cfg, comms, counter, rank, micro_limit=micro_limit)
    finally:
        dist.destroy_process_group()


def _child(cfg: RunConfig, rank: int, results: Any) -> None:
    """The body of one traced rank's process (``spawn``: nothing inherited but args)."""
    try:
        import torch

        torch.set_num_threads(1)
        start = time.perf_counter()
        traced = trace_here(cfg, rank)
        traced.wall_s = time.perf_counter() - start
        results.put((rank, True, traced.as_dict()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _start(ctx: Any, cfg: RunConfig, rank: int, results: Any) -> Any:
    """A traced rank's process, started with one OpenMP thread (its ops are metadata only)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        proc = ctx.Process(target=_child, args=(cfg, rank, results), daemon=True)
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return proc


def trace_ranks(
    cfg: RunConfig, ranks: list[int], jobs: int = 1, timeout_s: float = TIMEOUT_S
) -> list[RankTrace]:
    """Trace ``ranks``, each in a fresh process, at most ``jobs`` at a time; in rank order.

    A rank that fails, dies or runs past ``timeout_s`` stops the others and is raised here
    (its traceback, or one line naming it)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    waiting, running, done = list(ranks), {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < max(1, jobs):
                rank = waiting.pop(0)
                running[rank] = (_start(ctx, cfg, rank, results), time.monotonic())
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                _check_running(running, timeout_s)
                continue
            proc, _ = running.pop(rank)
            proc.join(timeout=30)
            if not ok:
                raise RuntimeError(f"tracing rank {rank} failed:\n{payload}")
            done[rank] = RankTrace(**payload)
    finally:
        for proc, _ in running.values():
            proc.kill()
            proc.join(timeout=30)
    return [done[r] for r in ranks]


def _check_running(running: dict[int, tuple[Any, float]], timeout_s: float) -> None:
    """Raise for a traced rank past its time or dead without a result."""
    for rank, (proc, started) in running.items():
        if time.monotonic() - started > timeout_s:
            raise BoostlrError(
                f"tracing rank {rank} took over {timeout_s:.0f} s: trace a smaller layout"
            )
        if not proc.is_alive() and proc.exitcode not in (None, 0):
            raise BoostlrError(
                f"tracing rank {rank} died (exit code {proc.exitcode}) before reporting: "
                "out of host memory? trace fewer ranks at a time (--trace-jobs 1)"
            )


def trace_rank(cfg: RunConfig, rank: int, timeout_s: float = TIMEOUT_S) -> RankTrace:
    """Trace one rank in a fresh process; its failure is raised here with its traceback."""
    return trace_ranks(cfg, [rank], 1, timeout_s)[0]


def default_jobs() -> int:
    """Traced ranks run one per core: each is one single-threaded process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def trace(
    cfg: RunConfig, ranks: list[int] | None = None, jobs: int | None = None
) -> list[RankTrace]:
    """One :class:`RankTrace` per role (or per rank of ``ranks``), one fresh process each,
    ``jobs`` at a time (default: one per core)."""
    cfg = planning_config(cfg)  # the preset's vocabulary when the config leaves it to the data
    world = cfg.parallel.world_size
    for r in ranks or ():
        if not 0 <= r < world:
            raise BoostlrError(f"--trace-rank {r} is not a rank of a world of {world}")
    chosen = sorted(set(ranks)) if ranks else traced_ranks(cfg)
    return trace_ranks(cfg, chosen, jobs or default_jobs())


def describe_rank(cfg: RunConfig, rank: int) -> str:
    pp, dp, tp = coordinates(cfg, rank)
    return f"rank {rank} (pp {pp}, dp {dp}, tp {tp})"
