"""Writing checkpoints: atomic, hashed as written, old ones deleted off the critical path.

The format (a DCP directory plus ``trainer.json``, the RNG files, the tokenizer and
``meta.json``) is described in :mod:`boostlr.rundir.checkpoint`.

Each file's sha256 is computed from the bytes as they are written (:mod:`.dcp_io`), never by
reading the checkpoint back. A save goes into ``.tmp-step_N``; when every rank's files are
complete and fsynced, rank 0 writes ``meta.json``, renames the directory into place and
fsyncs the parent. A crash at any moment leaves the previous checkpoint as the newest valid
one. Older checkpoints are deleted by a thread of rank 0 while training goes on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes

from boostlr.faults import crash_point
from boostlr.fsutil import fsync_dir, fsync_file
from boostlr.platform import bind_thread_device, pin_staging
from boostlr.rundir import dcp_io
from boostlr.rundir.checkpoint import FORMAT_VERSION, list_checkpoints, sha256_of
from boostlr.rundir.layout import META_FILE, TEMP_PREFIX, TRAINER_FILE, rng_file, step_dir_name
from boostlr.rundir.timeouts import CheckpointGroup, checkpoint_collectives, shard_bytes

_OLD_PREFIX = ".old-"  # a checkpoint replaced by a re-save of its step, deleted in background
_COPY_BLOCK = 1 << 20
_T = TypeVar("_T")


def _naming_timeouts(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a :class:`CheckpointWriter` method with its checkpoint-group timeout reported as
    one line naming the group (:func:`checkpoint_collectives`)."""

    @functools.wraps(method)
    def wrapped(self: CheckpointWriter, *args: Any, **kwargs: Any) -> _T:
        with checkpoint_collectives(self.timeout_s):
            return method(self, *args, **kwargs)

    return wrapped


@dataclass(frozen=True)
class SaveStats:
    """What a save cost: this rank's blocked seconds and shard bytes, and every rank's."""

    blocked_s: float
    nbytes: int
    blocked_s_by_rank: list[float]
    nbytes_by_rank: list[int]

    def row(self) -> dict[str, Any]:
        """The save's fields in ``metrics.jsonl`` (``ckpt_block_s`` is this rank's)."""
        return {
            "ckpt_block_s": self.blocked_s,
            "ckpt_block_s_by_rank": self.blocked_s_by_rank,
            "ckpt_bytes_by_rank": self.nbytes_by_rank,
            "ckpt_bytes": sum(self.nbytes_by_rank),
        }


class CheckpointWriter:
    """Writes this rank's part of each checkpoint; at most one save in flight.

    Collective over ``group`` (all ranks, gloo; ``None`` in a single process), whose timeout
    is ``timeout_s`` (:mod:`.timeouts`; a timed-out save is then one line naming the group).
    With ``async_save`` the shards are copied to host memory (pinned on CUDA) while the caller
    waits, then written and published by a background thread, so training continues.
    """

    def __init__(
        self,
        root: Path,
        rank: int,
        group: dist.ProcessGroup | None,
        keep: int,
        async_save: bool = False,
        device: torch.device | None = None,
        timeout_s: float | None = None,
    ):
        self.root, self.rank, self.group, self.keep = root, rank, group, keep
        self.timeout_s = timeout_s
        self.async_save = async_save
        self.device = device
        self._executor = (
            ThreadPoolExecutor(1, initializer=bind_thread_device, initargs=(device,))
            if async_save
            else None
        )
        self._pending: Future | None = None
        # Pinned staging buffers are slow to allocate: one stager, reused by every save.
        pin = async_save and pin_staging(device)
        self._stager = dcp_io.make_stager(pin=True) if pin else None
        self._cleaner = ThreadPoolExecutor(max_workers=1) if rank == 0 else None
        self.last_path: Path | None = None
        self.last_save_s: float | None = None  # the newest save's whole time, published
        self.estimate_s = 0.0  # what a first save is assumed to take (set by the trainer)
        self._started = 0.0

    @property
    def save_seconds(self) -> float:
        """How long a synchronous save takes: the newest one's time, else the estimate."""
        return self.estimate_s if self.last_save_s is None else self.last_save_s

    @classmethod
    def on_group(
        cls,
        root: Path,
        rank: int,
        ckpt: CheckpointGroup,
        keep: int,
        async_save: bool = False,
        device: torch.device | None = None,
    ) -> CheckpointWriter:
        """A writer that saves on ``ckpt``'s group and waits its timeout
        (:meth:`CheckpointGroup.size_to` sizes it to the shards first)."""
        return cls(root, rank, ckpt.group, keep, async_save, device, ckpt.timeout_s)

    @_naming_timeouts
    def save(
        self,
        step: int,
        state: dict[str, Any],
        trainer: dict[str, Any],
        rng: dict[str, torch.Tensor],
        meta: dict[str, Any],
        extra_files: dict[str, Path],
    ) -> SaveStats:
        """Save ``step``; returns what the save cost (the caller's blocked seconds first)."""
        started = time.perf_counter()
        self.wait()  # a previous save must be published before the next one starts
        self._started = time.perf_counter()
        final, tmp = self.root / step_dir_name(step), self.root / f"{TEMP_PREFIX}{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temp_dirs(self.root)
            tmp.mkdir()
        self._barrier()
        nbytes = shard_bytes(state)
        try:
            own = {}
            if self.rank == 0:
                own[TRAINER_FILE] = _write_hashed(tmp / TRAINER_FILE, _json_bytes(trainer))
            rng_bytes = safetensors_bytes({k: v.contiguous().cpu() for k, v in rng.items()})
            own[rng_file(self.rank)] = _write_hashed(tmp / rng_file(self.rank), rng_bytes)
            crash_point("ckpt_before_shards", self.rank, step)
            writer = dcp_io.HashingFileSystemWriter(tmp, self.device)
            if self.async_save:
                assert self._executor is not None
                stager = self._stager or dcp_io.make_stager(pin=False)
                staged = dcp_io.stage_state(stager, state)
                stats = self._stats(started, nbytes)  # the group is idle: nothing in flight
                written = dcp_io.async_save(staged, writer, self.group)
                done = None if stager is self._stager else stager
                self._pending = self._executor.submit(
                    self._publish, written, done, writer, own, step, tmp, final, meta, extra_files
                )
                return stats
            dcp_io.save(state, writer, self.group)
            self._publish(None, None, writer, own, step, tmp, final, meta, extra_files)
        except BaseException:
            if self.group is None:  # with several ranks the next save cleans up instead
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._stats(started, nbytes)

    def wait(self) -> Path | None:
        """Finish the save in flight, if any (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with checkpoint_collectives(self.timeout_s):
                pending.result()
        return self.last_path

    def close(self) -> None:
        """Finish the save in flight (a save is never dropped at exit) and the deletions."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._cleaner is not None:
                self._cleaner.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()

    def _publish(
        self,
        written: Future | None,
        stager: Any,
        writer: dcp_io.HashingFileSystemWriter,
        own: dict[str, dict[str, Any]],
        step: int,
        tmp: Path,
        final: Path,
        meta: dict[str, Any],
        extra_files: dict[str, Path],
    ) -> None:
        """Gather every rank's file hashes; rank 0 writes meta.json and renames into place."""
        if written is not None:
            written.result()
        if stager is not None:
            stager.close()  # a per-save (pageable) staging copy: free it now
        crash_point("ckpt_after_shards", self.rank, step)
        mine = {**own, **writer.digests}  # rank 0's include DCP's .metadata
        if self.group is None:
            infos = [mine]
        else:
            infos = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(infos, mine, group=self.group)
        if self.rank == 0:
            files: dict[str, Any] = {}
            for info in infos:
                files.update(info)
            for name, source in extra_files.items():
                files[name] = _copy_hashed(source, tmp / name)
            for file in sorted(tmp.iterdir()):  # anything DCP wrote around the hashing fs
                if file.name not in files:
                    fsync_file(file)
                    files[file.name] = {"size": file.stat().st_size, "sha256": sha256_of(file)}
            header = {"format": FORMAT_VERSION, "step": step, "sharded": True, "files": files}
            _write_hashed(tmp / META_FILE, _json_bytes({**header, **meta}))
            fsync_dir(tmp)
            crash_point("ckpt_before_rename", self.rank, step)
            if final.exists():  # an older save of the same step (a re-run after a resume)
                old = self.root / f"{_OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                self._in_background(shutil.rmtree, old, ignore_errors=True)
            os.rename(tmp, final)
            crash_point("ckpt_before_dir_fsync", self.rank, step)
            fsync_dir(self.root)
            self._in_background(prune_checkpoints, self.root, self.keep, step)
        self._barrier()
        self.last_path = final
        self.last_save_s = time.perf_counter() - self._started

    def _in_background(self, task: Any, *args: Any, **kwargs: Any) -> None:
        """Deletions run on rank 0's cleaner thread, in order; no rank waits for them."""
        assert self._cleaner is not None
        self._cleaner.submit(task, *args, **kwargs)

    def _stats(self, started: float, nbytes: int) -> SaveStats:
        blocked = time.perf_counter() - started
        if self.group is None:
            every = [(blocked, nbytes)]
        else:
            every = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, (blocked, nbytes), group=self.group)
        return SaveStats(blocked, nbytes, [b for b, _ in every], [n for _, n in every])

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _json_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=2).encode()


def _write_hashed(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` durably; its size and sha256 come from the bytes, not a re-read."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _copy_hashed(source: Path, target: Path) -> dict[str, Any]:
    """Copy ``source`` durably, hashing the bytes as they pass."""
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        for block in iter(lambda: src.read(_COPY_BLOCK), b""):
            dst.write(block)
            digest.update(block)
            size += len(block)
        dst.flush()
        os.fsync(dst.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def prune_checkpoints(root: Path, keep: int, written: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints up to the one just ``written``.

    The one just written is the newest complete checkpoint and is never deleted; nor is
    anything newer than it (those were set aside at resume and are left for the user to
    inspect), nor a save still in its temporary directory.
    """
    older = [c for c in list_checkpoints(root) if c.step < written]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for ckpt in doomed:
        shutil.rmtree(ckpt.path, ignore_errors=True)
    return [c.path for c in doomed]


def _remove_stale_temp_dirs(ckpt_root: Path) -> None:
    for prefix in (TEMP_PREFIX, _OLD_PREFIX):
        for child in ckpt_root.glob(f"{prefix}*"):
            shutil.rmtree(child, ignore_errors=True)
