"""Atomic, self-validating checkpoints: ``<run>/checkpoints/step_N/``.

A checkpoint is written into a hidden temp directory, every file fsynced, ``meta.json`` (which
lists each file's size and sha256) written last, then the directory is renamed into place. A
crash at any point leaves either the previous checkpoints untouched plus a stray temp dir
(ignored, cleaned on the next save) or a complete new one: nothing half-written ever loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from boostlr.errors import CheckpointError
from boostlr.fsutil import fsync_dir, fsync_file, sha256_file

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    extra_files: dict[str, Path] | None = None,
    keep: int | None = None,
) -> Path:
    """Write ``step_<step>`` atomically; keep only the newest ``keep`` checkpoints.

    ``extra_files`` (e.g. ``tokenizer.json``) are copied in so a checkpoint is self-contained.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(ckpt_root)
    final = ckpt_root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=ckpt_root))
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in model_state.items()}, tmp / MODEL_FILE
        )
        torch.save(trainer_state, tmp / TRAINER_FILE)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / name)
        files = {}
        for name in (MODEL_FILE, TRAINER_FILE, *(extra_files or {})):
            fsync_file(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        full_meta = {"format": FORMAT_VERSION, "step": step, "files": files, **meta}
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2))
        fsync_file(tmp / META_FILE)
        fsync_dir(tmp)
        if final.exists():  # an older save of the same step (e.g. a re-run after resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        for old in list_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Checkpoint]:
    """Valid checkpoints, oldest first. Invalid or partial ones are skipped."""
    found = []
    if not ckpt_root.is_dir():
        return found
    for child in ckpt_root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            meta = _read_valid_meta(child, verify_hashes=False)
            if meta is not None:
                found.append(Checkpoint(child, int(match.group(1)), meta))
    return sorted(found, key=lambda c: c.step)


def newest_checkpoint(ckpt_root: Path) -> Checkpoint | None:
    """The newest complete checkpoint (file sizes checked, not contents)."""
    ckpts = list_checkpoints(ckpt_root)
    return ckpts[-1] if ckpts else None


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint already verified by the caller (sizes re-checked, contents not rehashed)."""
    meta = _read_valid_meta(path, verify_hashes=False)
    if meta is None:
        raise CheckpointError(f"checkpoint {path} is incomplete: use an earlier checkpoint")
    return Checkpoint(path, int(meta["step"]), meta)


def newest_verified_checkpoint(ckpt_root: Path) -> tuple[Checkpoint | None, list[Path]]:
    """The newest checkpoint whose checksums verify, and the newer corrupted ones skipped."""
    skipped = []
    for ckpt in reversed(list_checkpoints(ckpt_root)):
        if _read_valid_meta(ckpt.path, verify_hashes=True) is not None:
            return ckpt, skipped
        skipped.append(ckpt.path)
    return None, skipped


def open_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint dir, or a run dir (its newest valid checkpoint); hashes verified."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        newest = newest_checkpoint(path / "checkpoints")
        if newest is None:
            raise CheckpointError(f"{path} has no complete checkpoint under checkpoints/")
        path = newest.path
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint (no {META_FILE}): pass runs/<run>/checkpoints/step_N "
            "or a run directory"
        )
    meta = _read_valid_meta(path, verify_hashes=True)
    if meta is None:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupted (file sizes or checksums do not "
            "match meta.json): use an earlier checkpoint"
        )
    return Checkpoint(path, int(meta["step"]), meta)


def load_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Full-shape weights by name (one process: export, generate, tests)."""
    if not ckpt.meta.get("sharded"):
        return load_file(ckpt.path / MODEL_FILE)
    metadata = dcp.FileSystemReader(str(ckpt.path)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith("model.") and hasattr(md, "size")
    }
    dcp.load(state, checkpoint_id=str(ckpt.path), no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def save_sharded_checkpoint(
    ckpt_root: Path,
    step: int,
    state: dict[str, Any],
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    extra_files: dict[str, Path],
    keep: int,
    rank: int,
) -> Path | None:
    """Every rank writes its own shards with ``torch.distributed.checkpoint`` (no gather).

    Collective over the default group. Into a temp directory first; rank 0 then hashes each
    file once, writes ``meta.json`` last, renames the directory into place and fsyncs.
    """
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f".tmp-step_{step}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_dirs(ckpt_root)
        tmp.mkdir()
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    trainer_file = tmp / f"trainer_rank{rank}.pt"
    torch.save(trainer_state, trainer_file)
    fsync_file(trainer_file)
    dist.barrier()
    if rank == 0:
        for name, source in extra_files.items():
            shutil.copyfile(source, tmp / name)
        files = {}
        for file in sorted(tmp.iterdir()):
            fsync_file(file)
            files[file.name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
        full_meta = {"format": FORMAT_VERSION, "step": step, "sharded": True, "files": files}
        (tmp / META_FILE).write_text(json.dumps({**full_meta, **meta}, indent=2))
        fsync_file(tmp / META_FILE)
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(ckpt_root)
        for old in list_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    dist.barrier()
    return final if rank == 0 else None


def load_sharded_state(ckpt: Checkpoint, state: dict[str, Any]) -> None:
    """Load a sharded checkpoint in place into ``state`` (this rank's DTensors)."""
    if not ckpt.meta.get("sharded"):
        raise CheckpointError(
            f"checkpoint {ckpt.path} was written by one process: resume it with one process "
            "(parallel degrees 1), or start a new run"
        )
    dcp.load(state, checkpoint_id=str(ckpt.path))


def load_trainer_state(ckpt: Checkpoint) -> dict[str, Any]:
    return torch.load(ckpt.path / TRAINER_FILE, weights_only=False)


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
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_stale_temp_dirs(ckpt_root: Path) -> None:
    for child in ckpt_root.glob(".tmp-step_*"):
        shutil.rmtree(child, ignore_errors=True)
