"""Per-rank bodies for checkpoint tests that need a process group but not a whole run."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from boostlr.config import build_config
from boostlr.parallel.engine import ParallelModel
from boostlr.rundir.timeouts import CheckpointGroup
from boostlr.rundir.writer import CheckpointWriter
from boostlr.train.optim import build_optimizer, init_optimizer_state

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PeakRss:
    """Samples this process's resident set every millisecond while active."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def save_memory(rank: int, world: int, root: str, async_save: bool) -> dict:
    """RSS growth of one save on this rank, against its shard bytes and largest tensor."""
    cfg = build_config(
        overrides=[
            ("model.preset", "tiny"),
            ("model.arch", "full"),
            ("model.dim", "256"),
            ("model.ffn_dim", "704"),
            ("model.vocab_size", "8192"),
            ("parallel.tp", str(world)),
        ]
    )
    model = ParallelModel.build(cfg, torch.device("cpu"))
    optimizer = build_optimizer(model.parameters(), cfg.train, fused=False)
    init_optimizer_state(optimizer)
    named = model.named_parameters()
    state = {"model": dict(named), "optim": {n: optimizer.state[p] for n, p in named}}
    local = [t.to_local() if hasattr(t, "to_local") else t for t in _tensors(state)]
    shard_bytes = sum(t.numel() * t.element_size() for t in local)
    largest = max(t.numel() * t.element_size() for t in local)
    ckpt = CheckpointGroup(world)  # the trainer's: all ranks on gloo, for checkpoints only
    ckpt.wait(cfg.parallel.timeout_s)
    writer = CheckpointWriter(Path(root), rank, ckpt.group, keep=2, async_save=async_save)
    dist.barrier()
    before = _rss()
    with PeakRss() as peak:
        writer.save(1, state, {"step": 1}, {"cpu": torch.get_rng_state()}, {}, {})
        writer.close()
    return {"growth": peak.peak - before, "shard_bytes": shard_bytes, "largest": largest}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if torch.is_tensor(value) and value.ndim > 0 else []


def group_timeouts(rank: int, world: int) -> dict:
    """The timeout of every group a run creates (default, each mesh dim, checkpoints)."""
    from boostlr.parallel.mesh import build_mesh

    cfg = build_config(
        overrides=[("parallel.tp", "2"), ("parallel.dp", "2"), ("parallel.timeout_s", "42")]
    )
    comms = build_mesh(cfg.parallel, torch.device("cpu"))
    ckpt = CheckpointGroup(world)
    ckpt.size_to({}, cfg.parallel.timeout_s)  # as the trainer makes it (no shards: no resize)
    cpu = torch.device("cpu")
    groups = {
        "tp": comms.tp.group,
        "dp": comms.dp.group,
        "pp": comms.pp.group,
        "ckpt": ckpt.group,
    }
    return {
        name: group._get_backend(cpu).options._timeout / timedelta(seconds=1)
        for name, group in groups.items()
    }


def slow_rank_save_and_load(
    rank: int, world: int, root: str, floor_s: float, mib: int, pace: float, sized: bool, slow: str
) -> dict:
    """Rank 1 writes (``slow="save"``) or reads (``"load"``) its shard at ``pace`` s/MiB
    while rank 0 waits on the checkpoint group: sized to the shards as the trainer sizes it,
    or left at ``floor_s``. Returns the group's timeout and each step's outcome."""
    from boostlr.faults import SLOW_IO_ENV
    from boostlr.parallel.mesh import build_mesh
    from boostlr.rundir.checkpoint import load_sharded_state, read_checkpoint
    from boostlr.rundir.timeouts import checkpoint_collectives

    cfg = build_config(overrides=[("parallel.dp", "2"), ("parallel.timeout_s", str(floor_s))])
    build_mesh(cfg.parallel, torch.device("cpu"))
    ckpt = CheckpointGroup(world)
    ckpt.wait(floor_s)
    state = {"model": {f"rank{rank}": torch.full((mib << 18,), float(rank))}}  # mib MiB
    if sized:
        ckpt.size_to(state, floor_s)
    report: dict = {"timeout_s": ckpt.timeout_s}
    writer = CheckpointWriter.on_group(Path(root), rank, ckpt, 1)
    try:
        for step in ("save", "load"):
            if rank == 1 and step == slow:
                os.environ[SLOW_IO_ENV] = str(pace)
            if step == "save":
                writer.save(1, state, {"step": 1}, {"cpu": torch.get_rng_state()}, {}, {})
                writer.close()
            else:
                loaded = {"model": {f"rank{rank}": torch.zeros(mib << 18)}}
                with checkpoint_collectives(ckpt.timeout_s):
                    load_sharded_state(read_checkpoint(Path(root) / "step_1"), loaded, ckpt.group)
                assert torch.equal(loaded["model"][f"rank{rank}"], state["model"][f"rank{rank}"])
            os.environ.pop(SLOW_IO_ENV, None)
            report[step] = "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        report["error"] = f"{type(exc).__name__}: {exc}"
    return report
