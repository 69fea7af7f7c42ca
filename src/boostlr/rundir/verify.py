"""Which checkpoint to resume from, verified by every rank at once.

Hashing a checkpoint of hundreds of gigabytes takes minutes. If one rank did it while the
others waited in a collective, the others' collective timeout (``parallel.timeout_s``; the
NCCL watchdog on GPUs) would end the job first. So the files are split into equal-byte
shares, each rank hashes its own share, and the ranks compare verdicts on the checkpoint
group, set to wait as long as the largest share takes (:mod:`.timeouts`, the rule saves and
loads follow too); the trainer's saves and loads use the same group afterwards. Every rank
reads the same listing (the run directory is on a file system every rank sees): the ranks
compare a sha256 of their listings, and a rank that sees another listing stops the resume
with one line naming it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from boostlr.errors import CheckpointError
from boostlr.rundir.checkpoint import Checkpoint, list_checkpoints, sha256_of
from boostlr.rundir.timeouts import CheckpointGroup, collective_timeout, io_timeout_s

VERIFY_GROUP = "checkpoint verification (gloo)"


def shares(files: dict[str, dict[str, Any]], world: int) -> list[list[str]]:
    """Split a checkpoint's files over ``world`` ranks, largest first to the lightest share:
    the same split on every rank, and shares within one file's size of each other."""
    split: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(files, key=lambda n: (-int(files[n]["size"]), n)):
        lightest = min(range(world), key=lambda r: (load[r], r))
        split[lightest].append(name)
        load[lightest] += int(files[name]["size"])
    return split


def first_bad_file(ckpt: Checkpoint, names: list[str]) -> str | None:
    """The first of ``names`` whose bytes do not match ``meta.json`` (``None``: all match)."""
    for name in names:
        info = ckpt.meta["files"][name]
        try:
            if sha256_of(ckpt.path / name) != info["sha256"]:
                return name
        except OSError:
            return name
    return None


def listing_digest(candidates: list[Checkpoint]) -> bytes:
    """sha256 of what a rank sees: each candidate's step and its files' sizes and hashes.

    The ranks compare these 32 bytes, not the listings: gathering every rank's listing
    would move world x listing bytes to each rank.
    """
    listing = [(c.step, sorted(c.meta["files"].items())) for c in candidates]
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).digest()


def odd_ranks(digests: list[bytes], named: int = 8) -> str:
    """Which ranks see another listing than most (``""`` when all agree), for one line."""
    count = Counter(digests)
    if len(count) == 1:
        return ""
    most = max(count, key=lambda d: (count[d], -digests.index(d)))
    odd = [r for r, d in enumerate(digests) if d != most]
    shown = ", ".join(map(str, odd[:named])) + (
        f" and {len(odd) - named} more" if len(odd) > named else ""
    )
    who = (
        f"rank {shown} of {len(digests)} sees"
        if len(odd) == 1
        else f"ranks {shown} of {len(digests)} see"
    )
    return f"{who} another listing than the other {count[most]}"


def verify_timeout(candidates: list[Checkpoint], world: int, floor_s: float) -> float:
    """Seconds the verification group waits: ``floor_s`` plus the largest share's hashing
    time at the slowest assumed rate (:func:`~.timeouts.io_timeout_s`)."""
    largest = 0
    for ckpt in candidates:
        files = ckpt.meta["files"]
        for share in shares(files, world):
            largest = max(largest, sum(int(files[n]["size"]) for n in share))
    return io_timeout_s(floor_s, largest)


class VerifyGroup:
    """The ranks that verify together, on the checkpoint group (:class:`~.timeouts.CheckpointGroup`)
    set to wait for the largest share (no group in one process, where nothing waits).

    With ``shared`` the group stays open after verification, for the trainer's saves and
    loads; without, it is destroyed when verification ends.
    """

    def __init__(
        self, rank: int, world: int, timeout_s: float, shared: CheckpointGroup | None = None
    ):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._owned = shared is None
        self._shared = CheckpointGroup(world) if shared is None else shared
        self._shared.wait(timeout_s)
        self.group = self._shared.group

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (one process: ``[value]``)."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world
        with collective_timeout(VERIFY_GROUP, self.timeout_s):
            dist.all_gather_object(out, value, group=self.group)
        return out

    def gather_digest(self, digest: bytes) -> list[bytes]:
        """Every rank's ``digest`` (all the same length: a fixed-size gather)."""
        if self.group is None:
            return [digest]
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        with collective_timeout(VERIFY_GROUP, self.timeout_s):
            dist.all_gather(out, mine, group=self.group)
        return [t.numpy().tobytes() for t in out]

    def close(self) -> None:
        if self._owned:
            self._shared.close()
        self.group = None


@contextmanager
def verification_group(
    candidates: list[Checkpoint],
    rank: int,
    world: int,
    floor_s: float,
    shared: CheckpointGroup | None = None,
) -> Iterator[VerifyGroup]:
    """A :class:`VerifyGroup` for ``candidates``, on ``shared`` when given (left open)."""
    group = VerifyGroup(rank, world, verify_timeout(candidates, world, floor_s), shared)
    try:
        yield group
    finally:
        group.close()


def newest_verified(
    candidates: list[Checkpoint], group: VerifyGroup
) -> tuple[Checkpoint | None, list[Path]]:
    """The newest of ``candidates`` whose checksums verify, and the newer corrupted ones.

    Collective over ``group``: every rank hashes its share of each candidate, the verdicts
    are compared; each file is hashed once overall.
    """
    digests = group.gather_digest(listing_digest(candidates))
    others = odd_ranks(digests)
    if others:
        root = candidates[0].path.parent if candidates else "the run directory"
        raise CheckpointError(
            f"--resume: the ranks see different checkpoints under {root} ({others}): put "
            "the run directory on a file system that every rank shares"
        )
    skipped = []
    for ckpt in reversed(candidates):
        bad = first_bad_file(ckpt, shares(ckpt.meta["files"], group.world)[group.rank])
        if all(verdict is None for verdict in group.gather(bad)):
            return ckpt, skipped
        skipped.append(ckpt.path)
    return None, skipped


def newest_verified_checkpoint(ckpt_root: Path) -> tuple[Checkpoint | None, list[Path]]:
    """One process: the newest checkpoint under ``ckpt_root`` whose checksums verify, and
    the newer corrupted ones skipped."""
    candidates = list_checkpoints(ckpt_root)
    with verification_group(candidates, 0, 1, 0.0) as group:
        return newest_verified(candidates, group)
