"""Finding, verifying and reading checkpoints: ``<run>/checkpoints/step_N/``.

Every checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory: each rank writes the
shards it holds (model and AdamW moments, keyed by the global parameter name with global
shapes), so no rank ever gathers a full tensor and any other layout can load it (DCP
reshards on load). Beside the shards: ``trainer.json`` (step, data position, learning-rate
schedule), one ``rng_rank{r}.safetensors`` per rank, the tokenizer, and ``meta.json`` —
config, layout and every file's size and sha256 — written last. Nothing is a pickle.

A save (:mod:`boostlr.rundir.writer`) goes into ``.tmp-step_N``; when every rank's files
are complete and fsynced, rank 0 writes ``meta.json``, renames the directory into place and
fsyncs the parent. A crash at any moment leaves the previous checkpoint as the newest valid
one. Verification spread over the ranks of a job is :mod:`boostlr.rundir.verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from boostlr.errors import CheckpointError
from boostlr.faults import throttle_hash
from boostlr.rundir import dcp_io
from boostlr.rundir.dcp_io import SafeFileSystemReader
from boostlr.rundir.layout import (
    CHECKPOINTS_DIR,
    META_FILE,
    STEP_DIR,
    TRAINER_FILE,
    checkpoints_dir,
    rng_file,
)

_BLOCK = 1 << 20

FORMAT_VERSION = 2


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]


# ---------------------------------------------------------------------------- finding


def sha256_of(path: Path, advance: Callable[[int], None] | None = None) -> str:
    """A file's sha256, read in 1 MiB blocks (``advance(n)`` after each, for a progress bar).

    Every verification hashes through here, so ``BOOSTLR_SLOW_HASH`` slows all of it.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            digest.update(block)
            throttle_hash(len(block))
            if advance is not None:
                advance(len(block))
    return digest.hexdigest()


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
    dcp_io.load(state, ckpt.path, None)
    return {key.removeprefix("model."): value for key, value in state.items()}


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
    dcp_io.load(state, ckpt.path, group)


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
            if verify_hashes and sha256_of(file) != info["sha256"]:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
