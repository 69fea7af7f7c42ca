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
    return load_file(ckpt.path / MODEL_FILE)


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
