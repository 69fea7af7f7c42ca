"""Which checkpoint a run continues from, what may change when it does, and the run
directory's first writing (:func:`prepare_run_dir`).

The config saved in the checkpoint is authoritative for everything that decides the data
order or the optimizer's arithmetic; changing one of those on ``--resume`` would silently
train a different run, so it exits 2 naming the keys. The layout (``parallel.*``), the split
of the global batch into micro-batches, logging cadence and ``train.steps`` may change.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boostlr.config import RunConfig, dump_toml, to_dict
from boostlr.data import TokenDataset
from boostlr.errors import BoostlrError, CheckpointError, ConfigError
from boostlr.fsutil import write_text_atomic
from boostlr.rundir.checkpoint import Checkpoint, list_checkpoints, set_aside
from boostlr.rundir.layout import CONFIG_FILE, STEP_DIR, TOKENIZER_FILE, checkpoints_dir
from boostlr.rundir.timeouts import CheckpointGroup
from boostlr.rundir.verify import newest_verified, verification_group

Saved = dict[str, dict[str, Any]]


def _global_batch(cfg: Saved) -> int:
    t, p = cfg["train"], cfg["parallel"]
    return int(t["batch_size"]) * int(t["grad_accum"]) * int(p["dp"])


# Values that fix the data order or the optimizer (the model config is checked whole).
GUARDED: dict[str, Callable[[Saved], Any]] = {
    "data.path": lambda c: c["data"]["path"],
    "data.default_vocab": lambda c: c["data"]["default_vocab"] if not c["data"]["path"] else None,
    "data.seq_len": lambda c: c["data"]["seq_len"],
    "train.global_batch (batch_size x grad_accum x dp)": _global_batch,
    "train.seed": lambda c: c["train"]["seed"],
    "train.lr": lambda c: c["train"]["lr"],
    "train.min_lr_ratio": lambda c: c["train"]["min_lr_ratio"],
    "train.warmup": lambda c: c["train"]["warmup"],
    "train.weight_decay": lambda c: c["train"]["weight_decay"],
    "train.beta1": lambda c: c["train"]["beta1"],
    "train.beta2": lambda c: c["train"]["beta2"],
    "train.eps": lambda c: c["train"]["eps"],
    "train.grad_clip": lambda c: c["train"]["grad_clip"],
    "train.dtype": lambda c: c["train"]["dtype"],
}


def check_resume_config(ckpt: Checkpoint, cfg: RunConfig) -> None:
    """Refuse a resume that would change the model, the data order or the optimizer."""
    saved = ckpt.meta.get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointError(f"checkpoint {ckpt.path} has no saved config: it is not a run's")
    current = to_dict(cfg)
    if saved["model"] != current["model"]:
        changes = ", ".join(
            f"model.{k} {saved['model'].get(k)!r} -> {v!r}"
            for k, v in current["model"].items()
            if saved["model"].get(k) != v
        )
        raise CheckpointError(
            f"--resume: the model config differs from the one saved in {ckpt.path} "
            f"({changes}): drop the --model.* overrides when resuming"
        )
    changed = []
    for key, value in GUARDED.items():
        try:
            before = value(saved)
        except KeyError:  # a checkpoint from before the key existed
            continue
        after = value(current)
        if before != after:
            changed.append(f"{key} {before!r} -> {after!r}")
    if changed:
        raise CheckpointError(
            f"--resume: {'; '.join(changed)} (saved in {ckpt.path}): these decide the data "
            "order or the optimizer, so the saved config is kept; drop the overrides, or "
            "start a new run (--run-dir) to train with them"
        )
    if cfg.train.steps < ckpt.step:
        raise CheckpointError(
            f"--resume: train.steps {cfg.train.steps} is before the checkpoint's step "
            f"{ckpt.step}: pass --train.steps {ckpt.step} or more"
        )


def pick_checkpoint(run_dir: Path, required: bool) -> Checkpoint | None:
    """One process: the newest checkpoint whose hashes verify; newer corrupted ones are set
    aside. Inside a job's ranks :func:`prepare_run_dir` verifies it with every rank."""
    candidates = list_checkpoints(checkpoints_dir(run_dir))
    with verification_group(candidates, 0, 1, 0.0) as group:
        ckpt, corrupted = newest_verified(candidates, group)
    return _keep(run_dir, ckpt, corrupted, required)


def _keep(
    run_dir: Path, ckpt: Checkpoint | None, corrupted: list[Path], required: bool
) -> Checkpoint | None:
    """The checkpoint to resume, after setting ``corrupted`` aside.

    A run stopped before its first save (preempted, or killed with a rank) has no
    ``step_N`` directory at all: ``--resume`` starts it from step 0 with its saved config,
    as its first start did. Damaged ``step_N`` directories and nothing intact are an error:
    starting over would silently discard the run.
    """
    for path in set_aside(corrupted):
        print(f"boostlr: warning: corrupted checkpoint set aside as {path}", file=sys.stderr)
    if ckpt is None and required:
        if corrupted or _step_dirs(run_dir):
            raise CheckpointError(
                f"--resume: {run_dir} has no complete checkpoint: start a fresh run without "
                "--resume (or point --run-dir at the run to continue)"
            )
        print(
            f"boostlr: --resume: {run_dir} has no checkpoint yet: starting it from step 0 "
            f"with its {CONFIG_FILE}",
            file=sys.stderr,
            flush=True,
        )
    return ckpt


def _step_dirs(run_dir: Path) -> list[Path]:
    """``step_N`` directories, complete or not (an unfinished save's temporary one is not)."""
    root = checkpoints_dir(run_dir)
    return [p for p in root.iterdir() if STEP_DIR.match(p.name)] if root.is_dir() else []


def prepare_run_dir(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    dataset: TokenDataset,
    required: bool = True,
    rank: int = 0,
    world: int = 1,
    group: CheckpointGroup | None = None,
) -> str | None:
    """Check the run directory, then write its config and tokenizer; the checkpoint to resume.

    A new run refuses a directory that holds one; ``--resume`` (or a restart) picks and
    verifies the newest complete checkpoint and checks the config is compatible with it
    (none yet: the run starts again from step 0, :func:`_keep`).
    With ``world > 1`` every rank of the job calls it: the ranks hash equal shares of the
    checkpoint and wait for each other only on a gloo group sized to that work
    (:mod:`boostlr.rundir.verify`); rank 0 alone writes, and every rank raises its error.
    That group is ``group`` when given, left open for the trainer's saves and loads.
    """
    candidates = list_checkpoints(checkpoints_dir(run_dir)) if resume else []
    floor_s = cfg.parallel.timeout_s
    with verification_group(candidates, rank, world, floor_s, group) as verifying:
        ckpt, corrupted = newest_verified(candidates, verifying) if resume else (None, [])
        error: BoostlrError | None = None
        if rank == 0:
            try:
                ckpt = _write_run_dir(cfg, run_dir, resume, dataset, required, ckpt, corrupted)
            except BoostlrError as exc:
                error = exc
        first = verifying.gather(None if error is None else str(error))[0]
        if error is not None:
            raise error
        if first is not None:
            raise BoostlrError(first)
    return str(ckpt.path) if ckpt else None


def _write_run_dir(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    dataset: TokenDataset,
    required: bool,
    ckpt: Checkpoint | None,
    corrupted: list[Path],
) -> Checkpoint | None:
    """Rank 0's part: set corrupted checkpoints aside, check, write config and tokenizer."""
    if resume:
        if required and not (run_dir / CONFIG_FILE).is_file():  # a mistyped path
            raise CheckpointError(
                f"--resume: {run_dir} holds no run (no {CONFIG_FILE}): point --run-dir at the "
                "run to continue, or start a new run without --resume"
            )
        ckpt = _keep(run_dir, ckpt, corrupted, required)
        if ckpt is not None:
            check_resume_config(ckpt, cfg)
    elif (run_dir / CONFIG_FILE).exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run: pass --resume to continue it "
            "or choose a new --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / TOKENIZER_FILE).exists():
        shutil.copyfile(dataset.tokenizer_path, run_dir / TOKENIZER_FILE)
    write_text_atomic(run_dir / CONFIG_FILE, dump_toml(cfg))
    return ckpt
