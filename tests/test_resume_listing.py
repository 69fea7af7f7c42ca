"""Resuming ranks compare a digest of their checkpoint listings, not the listings.

A checkpoint of a large job lists thousands of files; all-gathering every rank's listing
would move world x listing bytes to each rank. The ranks here run on real gloo groups and
their collectives are recorded (the real ones still run) while they verify.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from boostlr.errors import CheckpointError
from boostlr.rundir.checkpoint import Checkpoint
from boostlr.rundir.verify import newest_verified, odd_ranks, verification_group


def checkpoint(root: Path, step: int, nfiles: int) -> Checkpoint:
    """A checkpoint of ``nfiles`` small files with their true sizes and hashes."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    files = {}
    for i in range(nfiles):
        data = f"shard {i} of step {step}".encode()
        (path / f"__{i}_0.distcp").write_bytes(data)
        files[f"__{i}_0.distcp"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return Checkpoint(path, step, {"files": files})


def _payload_bytes(value: Any) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    return len(pickle.dumps(value))


def _verify_recording(rank: int, world: int, root: str, sizes: list[int], odd: int) -> dict:
    sent: list[int] = []
    gather, gather_object = dist.all_gather, dist.all_gather_object

    def recorded_gather(out: Any, tensor: torch.Tensor, **kwargs: Any) -> Any:
        sent.append(_payload_bytes(tensor))
        return gather(out, tensor, **kwargs)

    def recorded_gather_object(out: Any, obj: Any, **kwargs: Any) -> Any:
        sent.append(_payload_bytes(obj))
        return gather_object(out, obj, **kwargs)

    dist.all_gather, dist.all_gather_object = recorded_gather, recorded_gather_object
    report: dict = {"sent": {}}
    for nfiles in sizes:  # the same two checkpoints on every rank, listings of nfiles files
        base = Path(root) / f"rank{rank}" / str(nfiles)
        candidates = [checkpoint(base, 1, nfiles), checkpoint(base, 2, nfiles)]
        sent.clear()
        with verification_group(candidates, rank, world, 60.0) as group:
            ckpt, skipped = newest_verified(candidates, group)
        assert ckpt is not None and ckpt.step == 2 and skipped == []
        report["sent"][nfiles] = list(sent)
    # One rank sees a checkpoint more than the others: every rank stops, naming it.
    base = Path(root) / f"rank{rank}" / "odd"
    candidates = [checkpoint(base, 1, 3)] + ([checkpoint(base, 2, 3)] if rank == odd else [])
    try:
        with verification_group(candidates, rank, world, 60.0) as group:
            newest_verified(candidates, group)
    except CheckpointError as exc:
        report["error"] = str(exc)
    return report


def test_ranks_compare_fixed_size_digests_and_name_the_odd_rank(tmp_path: Path) -> None:
    reports = run_distributed(_verify_recording, 3, str(tmp_path), [4, 400], 2)
    for report in reports:
        small, large = report["sent"][4], report["sent"][400]
        assert small == large, (small, large)  # a hundred times the files: the same bytes
        assert max(large) <= 32  # nothing on the wire is a listing
        error = report["error"]
        assert error.startswith("--resume: the ranks see different checkpoints under ")
        assert "rank 2 of 3 sees another listing than the other 2" in error
        assert error.endswith("put the run directory on a file system that every rank shares")
        assert "\n" not in error


@pytest.mark.parametrize(
    ("digests", "named"),
    [
        ([b"a", b"a", b"a"], ""),
        ([b"a", b"b", b"a", b"a"], "rank 1 of 4 sees another listing than the other 3"),
        ([b"b", b"a", b"a"], "rank 0 of 3 sees another listing than the other 2"),
        ([b"a", b"b"], "rank 1 of 2 sees another listing than the other 1"),
        (
            [b"a"] * 3 + [b"b"] * 10 + [b"c"] * 20,
            "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 5 more of 33 see another listing than the other 20",
        ),
    ],
)
def test_the_odd_ranks_are_those_outside_the_largest_agreement(
    digests: list[bytes], named: str
) -> None:
    assert odd_ranks(digests) == named
