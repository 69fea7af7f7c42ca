"""Atomic, self-validating, sharded checkpoints: ``<run>/checkpoints/step_N/``.

Every checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory: each rank writes the
shards it holds (model and AdamW moments, keyed by the global parameter name with global
shapes), so no rank ever gathers a full tensor and any other layout can load it (DCP
reshards on load). Beside the shards: ``trainer.json`` (step, data position, learning-rate
schedule), one ``rng_rank{r}.safetensors`` per rank, the tokenizer, and ``meta.json`` —
config, layout and every file's size and sha256 — written last. Nothing is a pickle.

A save goes into ``.tmp-step_N``; when every rank's files are complete and fsynced, rank 0
writes ``meta.json``, renames the directory into place and fsyncs the parent. A crash at
any moment leaves the previous checkpoint as the newest valid one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from boostlr.errors import CheckpointError
from boostlr.faults import crash_point
from boostlr.fsutil import fsync_dir, fsync_file, sha256_file
from boostlr.rundir.layout import (
    CHECKPOINTS_DIR,
    META_FILE,
    STEP_DIR,
    TEMP_PREFIX,
    TRAINER_FILE,
    checkpoints_dir,
    rng_file,
    step_dir_name,
)

FORMAT_VERSION = 2


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]


# ---------------------------------------------------------------------------- writing


class CheckpointWriter:
    """Writes this rank's part of each checkpoint; at most one save in flight.

    Collective over ``group`` (all ranks, gloo; ``None`` in a single process). With
    ``async_save`` the shards are copied to host memory while the caller waits, then written,
    hashed and published by a background thread, so training continues meanwhile.
    """

    def __init__(
        self,
        root: Path,
        rank: int,
        group: dist.ProcessGroup | None,
        keep: int,
        async_save: bool = False,
    ):
        self.root, self.rank, self.group, self.keep = root, rank, group, keep
        self.async_save = async_save
        self._executor = ThreadPoolExecutor(max_workers=1) if async_save else None
        self._pending: Future | None = None
        self.last_path: Path | None = None

    def save(
        self,
        step: int,
        state: dict[str, Any],
        trainer: dict[str, Any],
        rng: dict[str, torch.Tensor],
        meta: dict[str, Any],
        extra_files: dict[str, Path],
    ) -> float:
        """Save ``step``; returns the seconds the caller was blocked."""
        started = time.perf_counter()
        self.wait()  # a previous save must be published before the next one starts
        final, tmp = self.root / step_dir_name(step), self.root / f"{TEMP_PREFIX}{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temp_dirs(self.root)
            tmp.mkdir()
        self._barrier()
        try:
            self._start(step, tmp, final, state, trainer, rng, meta, extra_files)
        except BaseException:
            if self.group is None:  # with several ranks the next save cleans up instead
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return time.perf_counter() - started

    def _start(
        self,
        step: int,
        tmp: Path,
        final: Path,
        state: dict[str, Any],
        trainer: dict[str, Any],
        rng: dict[str, torch.Tensor],
        meta: dict[str, Any],
        extra_files: dict[str, Path],
    ) -> None:
        if self.rank == 0:
            _write_json(tmp / TRAINER_FILE, trainer)
        save_file({k: v.contiguous().cpu() for k, v in rng.items()}, tmp / rng_file(self.rank))
        crash_point("ckpt_before_shards", self.rank, step)
        if self.async_save:
            assert self._executor is not None
            with _quiet_dcp():
                written = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
            self._pending = self._executor.submit(
                self._publish, written, step, tmp, final, meta, extra_files
            )
        else:
            with _quiet_dcp():
                dcp.save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
            self._publish(None, step, tmp, final, meta, extra_files)

    def wait(self) -> Path | None:
        """Finish the save in flight, if any (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        return self.last_path

    def close(self) -> None:
        """Finish the save in flight (a save is never dropped at exit), stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _publish(
        self,
        written: Future | None,
        step: int,
        tmp: Path,
        final: Path,
        meta: dict[str, Any],
        extra_files: dict[str, Path],
    ) -> None:
        """Hash this rank's files, then rank 0 writes meta.json and renames into place."""
        if written is not None:
            written.result()
        crash_point("ckpt_after_shards", self.rank, step)
        own = [f for f in sorted(tmp.iterdir()) if _owned_by(f.name, self.rank)]
        mine = {f.name: _file_info(f) for f in own}  # every rank hashes its own files
        if self.group is None:
            infos = [mine]
        else:
            infos = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(infos, mine, group=self.group)
        if self.rank == 0:
            for name, source in extra_files.items():
                shutil.copyfile(source, tmp / name)
            files: dict[str, Any] = {}
            for info in infos:
                files.update(info)
            for file in sorted(tmp.iterdir()):  # .metadata, trainer.json, extra files
                if file.name not in files:
                    files[file.name] = _file_info(file)
            header = {"format": FORMAT_VERSION, "step": step, "sharded": True, "files": files}
            _write_json(tmp / META_FILE, {**header, **meta})
            fsync_dir(tmp)
            crash_point("ckpt_before_rename", self.rank, step)
            if final.exists():  # an older save of the same step (a re-run after a resume)
                shutil.rmtree(final)
            os.rename(tmp, final)
            crash_point("ckpt_before_dir_fsync", self.rank, step)
            fsync_dir(self.root)
            prune_checkpoints(self.root, keep=self.keep, written=step)
        self._barrier()
        self.last_path = final

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every one-process save/load that it "assumes" one process: we ask for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _owned_by(name: str, rank: int) -> bool:
    """The files a rank wrote: its DCP shards ``__{rank}_*.distcp`` and its RNG state."""
    return name.startswith(f"__{rank}_") or name == rng_file(rank)


def _file_info(file: Path) -> dict[str, Any]:
    fsync_file(file)
    return {"size": file.stat().st_size, "sha256": sha256_file(file)}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))
    fsync_file(path)


def prune_checkpoints(root: Path, keep: int, written: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints up to the one just ``written``.

    The one just written is the newest verified checkpoint (its hashes were computed from
    the files themselves) and is never deleted; nor is anything newer than it (those were
    set aside at resume and are left for the user to inspect).
    """
    older = [c for c in list_checkpoints(root) if c.step < written]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for ckpt in doomed:
        shutil.rmtree(ckpt.path, ignore_errors=True)
    return [c.path for c in doomed]


# ---------------------------------------------------------------------------- finding


def list_checkpoints(ckpt_root: Path) -> list[Checkpoint]:
    """Complete checkpoints (file sizes checked, not contents), oldest first."""
    found = []
    if not ckpt_root.is_dir():
        return found
    for child in ckpt_root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            meta = _read_valid_meta(child, verify_hashes=False)
            if meta is not None:
                found.append(Checkpoint(child, int(match.group(1)), meta))
    return sorted(found, key=lambda c: c.step)


def newest_checkpoint(ckpt_root: Path) -> Checkpoint | None:
    """The newest complete checkpoint (file sizes checked, not contents)."""
    ckpts = list_checkpoints(ckpt_root)
    return ckpts[-1] if ckpts else None


def _invalid_reason(path: Path) -> str:
    """Why ``meta.json`` in ``path`` was not valid: another format is named as such."""
    try:
        found = json.loads((path / META_FILE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        found = None
    if found is not None and found != FORMAT_VERSION:
        return (
            f"checkpoint {path} has format {found}; this boostlr reads format {FORMAT_VERSION} "
            "(sharded DCP directories) only: use a checkpoint written by this version"
        )
    return (
        f"checkpoint {path} is incomplete or corrupted (file sizes or checksums do not "
        "match meta.json): use an earlier checkpoint"
    )


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint already verified by the caller (sizes re-checked, contents not rehashed)."""
    meta = _read_valid_meta(path, verify_hashes=False)
    if meta is None:
        raise CheckpointError(f"checkpoint {path} is incomplete: use an earlier checkpoint")
    return Checkpoint(path, int(meta["step"]), meta)


def newest_verified_checkpoint(ckpt_root: Path) -> tuple[Checkpoint | None, list[Path]]:
    """The newest checkpoint whose checksums verify, and the newer corrupted ones skipped.

    Hashes each file once; call it on one rank and share the answer.
    """
    skipped = []
    for ckpt in reversed(list_checkpoints(ckpt_root)):
        if _read_valid_meta(ckpt.path, verify_hashes=True) is not None:
            return ckpt, skipped
        skipped.append(ckpt.path)
    return None, skipped


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename corrupted checkpoints to ``corrupt-step_N`` so no later listing sees them."""
    moved = []
    for path in paths:
        target = path.with_name(f"corrupt-{path.name}-{int(time.time())}")
        os.rename(path, target)
        moved.append(target)
    return moved


def open_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint dir, or a run dir (its newest valid checkpoint); hashes verified."""
    path = Path(path)
    if checkpoints_dir(path).is_dir():
        newest = newest_checkpoint(checkpoints_dir(path))
        if newest is None:
            raise CheckpointError(f"{path} has no complete checkpoint under {CHECKPOINTS_DIR}/")
        path = newest.path
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint (no {META_FILE}): pass runs/<run>/checkpoints/step_N "
            "or a run directory"
        )
    meta = _read_valid_meta(path, verify_hashes=True)
    if meta is None:
        raise CheckpointError(_invalid_reason(path))
    return Checkpoint(path, int(meta["step"]), meta)


# ---------------------------------------------------------------------------- reading


def load_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Full-shape weights by name, in one process (tests; export streams instead)."""
    state = {
        key: torch.empty(shape, dtype=dtype)
        for key, (shape, dtype) in dcp_tensor_entries(ckpt.path).items()
        if key.startswith("model.")
    }
    with _quiet_dcp():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt.path)), no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: only its own classes may load.

    DCP reads ``.metadata`` with a bare ``pickle.load`` (the shards it reads with
    ``weights_only``); a crafted file could run any code. This allowlist is what the
    metadata of a boostlr checkpoint holds.
    """

    ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or name in self.ALLOWED.get(module, ())
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def dcp_tensor_entries(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a DCP directory holds: flattened key -> (global shape, dtype)."""
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # a foreign, damaged or malicious .metadata
        raise CheckpointError(
            f"{path}: unreadable DCP metadata ({exc}): use another checkpoint"
        ) from None
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.items()
        if hasattr(md, "size")
    }


def load_sharded_state(
    ckpt: Checkpoint, state: dict[str, Any], group: dist.ProcessGroup | None
) -> None:
    """Load a DCP checkpoint in place into ``state`` — any layout into any other."""
    missing = _missing_keys(ckpt.path, state)
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not hold {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}: resume with the run's own model config"
        )
    with _quiet_dcp():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(ckpt.path)),
            process_group=group,
            no_dist=group is None,
        )


def _missing_keys(path: Path, state: dict[str, Any]) -> list[str]:
    saved = dcp_tensor_entries(path)
    wanted = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        elif torch.is_tensor(value):
            wanted.append(prefix)

    walk("", state)
    return [key for key in wanted if key not in saved]


def load_trainer_state(ckpt: Checkpoint, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer state, this rank's RNG state)`` — JSON and tensors, loaded to the CPU.

    A rank that did not exist at save time (the world grew) takes rank 0's RNG state.
    """
    path = ckpt.path
    if not (path / TRAINER_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} has no trainer state: use another checkpoint")
    trainer = json.loads((path / TRAINER_FILE).read_text())
    own = path / rng_file(rank)
    rng = load_file(own if own.is_file() else path / rng_file(0))
    return trainer, rng


def _read_valid_meta(path: Path, verify_hashes: bool) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format") != FORMAT_VERSION:
            return None
        for name, info in meta["files"].items():
            file = path / name
            if not file.is_file() or file.stat().st_size != info["size"]:
                return None
            if verify_hashes and sha256_file(file) != info["sha256"]:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remove_stale_temp_dirs(ckpt_root: Path) -> None:
    for child in ckpt_root.glob(f"{TEMP_PREFIX}*"):
        shutil.rmtree(child, ignore_errors=True)
