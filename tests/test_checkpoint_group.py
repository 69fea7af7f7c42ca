"""One gloo group of every rank serves checkpoint verification, saves and loads.

Each gloo group holds a connection from every rank to every other: at thousands of ranks a
second one alive at the same time doubles every rank's sockets, and each one made is a
rendezvous of the whole job. So the group resume verifies on is the one the trainer saves
on, and resizing it (a group's timeout is fixed when it is made) destroys the old group
before the new one is made. The ranks run on real gloo groups; making and destroying
groups is recorded, not replaced.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed import run_distributed

from boostlr.config import build_config
from boostlr.rundir.checkpoint import Checkpoint

CPU = torch.device("cpu")


def _timeout_s(group: dist.ProcessGroup) -> float:
    return group._get_backend(CPU).options._timeout / timedelta(seconds=1)


def _record_groups(log: list[tuple[str, int]]) -> None:
    """Log each all-ranks group made (the checkpoint group's way) and each group destroyed."""
    new_group, destroy = dist.new_group, dist.destroy_process_group

    def recorded_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        if not args and "ranks" not in kwargs:  # the mesh's dims name their ranks
            log.append(("new", id(group)))
        return group

    def recorded_destroy(group: Any = None) -> None:
        log.append(("destroy", id(group)))
        destroy(group)

    dist.new_group, dist.destroy_process_group = recorded_new_group, recorded_destroy


def _most_alive(log: list[tuple[str, int]]) -> int:
    alive: set[int] = set()
    most = 0
    for event, group in log:
        if event == "new":
            alive.add(group)
        else:
            alive.discard(group)
        most = max(most, len(alive))
    return most


def _resize(rank: int, world: int) -> dict:
    from boostlr.parallel.mesh import build_mesh
    from boostlr.rundir.timeouts import CheckpointGroup

    cfg = build_config(overrides=[("parallel.dp", "2"), ("parallel.timeout_s", "5")])
    log: list[tuple[str, int]] = []
    _record_groups(log)
    build_mesh(cfg.parallel, CPU)
    ckpt = CheckpointGroup(world)
    ckpt.size_to({}, cfg.parallel.timeout_s)  # the trainer's, before it knows the shards
    first, first_timeout_s = ckpt.group, _timeout_s(ckpt.group)
    ckpt.wait(9.0)
    resized = ckpt.group
    dist.barrier(group=resized)  # the new group works
    ckpt.wait(9.0)
    return {
        "log": [(e, "first" if g == id(first) else "other") for e, g in log],
        "most_alive": _most_alive(log),
        "timeout_s": (first_timeout_s, _timeout_s(resized)),
        "same_again": ckpt.group is resized,
    }


def test_resizing_the_checkpoint_group_destroys_the_old_one_first() -> None:
    for report in run_distributed(_resize, 2):
        assert report["log"] == [("new", "first"), ("destroy", "first"), ("new", "other")]
        assert report["most_alive"] == 1
        assert report["timeout_s"] == (5.0, 9.0)
        assert report["same_again"]  # an unchanged timeout makes nothing


def _checkpoint(root: Path) -> Checkpoint:
    path = root / "step_1"
    path.mkdir(parents=True)
    data = b"one shard"
    (path / "__0_0.distcp").write_bytes(data)
    info = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return Checkpoint(path, 1, {"files": {"__0_0.distcp": info}})


def _verify_then_save(rank: int, world: int, root: str) -> dict:
    from boostlr.parallel.mesh import build_mesh
    from boostlr.rundir.timeouts import CheckpointGroup
    from boostlr.rundir.verify import newest_verified, verification_group, verify_timeout
    from boostlr.rundir.writer import CheckpointWriter

    cfg = build_config(overrides=[("parallel.dp", "2"), ("parallel.timeout_s", "5")])
    log: list[tuple[str, int]] = []
    _record_groups(log)
    candidates = [_checkpoint(Path(root) / f"rank{rank}")]
    shared = CheckpointGroup(world)
    with verification_group(candidates, rank, world, 5.0, shared) as verifying:
        ckpt, _ = newest_verified(candidates, verifying)
        verified_on = verifying.group
    assert ckpt is not None
    build_mesh(cfg.parallel, CPU)
    taken = shared.group is verified_on
    verified_timeout_s = shared.timeout_s
    shared.wait(7.0)
    writer = CheckpointWriter(Path(root) / "run", rank, shared.group, 1, timeout_s=7.0)
    writer.save(1, {"w": torch.full((4,), float(rank))}, {}, {"cpu": torch.get_rng_state()}, {}, {})
    writer.close()
    return {
        "made": sum(e == "new" for e, _ in log),
        "most_alive": _most_alive(log),
        "taken": taken,
        "timeouts": (verified_timeout_s, _timeout_s(shared.group)),
        "verify_timeout_s": verify_timeout(candidates, world, 5.0),
    }


def test_verification_and_saves_share_one_checkpoint_group(tmp_path: Path) -> None:
    for report in run_distributed(_verify_then_save, 2, str(tmp_path)):
        assert report["taken"]  # the mesh saves on the group resume verified on
        assert report["made"] == 2  # verification's, then the one sized to the shards
        assert report["most_alive"] == 1
        assert report["timeouts"] == (report["verify_timeout_s"], 7.0)
    assert (tmp_path / "run" / "step_1" / "meta.json").is_file()
