"""What a rank trains (:class:`RunState`) and how it goes into and out of a checkpoint.

The step loop in :mod:`boostlr.train.loop` advances a RunState; this module turns one into
the checkpoint's state dict (this rank's shards by global name), saves it, and restores it
at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from boostlr.config import RunConfig, from_dict, to_dict
from boostlr.data import BatchLoader
from boostlr.parallel.engine import ParallelModel
from boostlr.train.checkpoint import (
    Checkpoint,
    CheckpointWriter,
    load_sharded_state,
    load_trainer_state,
)
from boostlr.train.memory import MemoryPhases
from boostlr.train.optim import Anchor, lr_at, reanchor

TOKENIZER_FILE = "tokenizer.json"


@dataclass
class RunState:
    """What the step loop advances: this rank's model part, optimizer and data position."""

    cfg: RunConfig
    run_dir: Path
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    val_data: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    writer: CheckpointWriter
    rank: int
    phases: MemoryPhases | None = None
    restart_attempt: int = 0  # how often the launcher restarted this run's ranks
    start_step: int = 0
    lr_anchor: Anchor | None = None

    @property
    def distributed(self) -> bool:
        return self.model.comms.mesh is not None

    def lr(self, step: int) -> float:
        return lr_at(step, self.cfg.train, self.lr_anchor)


def restore(state: RunState, ckpt: Checkpoint) -> None:
    """Weights, AdamW moments, data position, RNG and schedule — at any layout."""
    load_sharded_state(ckpt, sharded_state(state), state.model.comms.ckpt_group)
    trainer, rng = load_trainer_state(ckpt, state.rank)
    state.loader.load_state_dict(trainer["loader"])
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda{i}" in rng:
                torch.cuda.set_rng_state(rng[f"cuda{i}"], i)
    state.start_step = ckpt.step
    schedule = trainer.get("lr_schedule") or {}
    anchor = tuple(schedule["anchor"]) if schedule.get("anchor") else None
    saved_train = from_dict(ckpt.meta["config"]).train
    state.lr_anchor = reanchor(saved_train, anchor, state.cfg.train, ckpt.step)


def layout_of(cfg: RunConfig) -> dict:
    p = cfg.parallel
    return {
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
        "strategy": p.strategy_for(cfg.model.arch),
        "stages_per_rank": p.virtual_stages,
        "dp_mode": p.dp_mode if p.dp > 1 else None,
    }


def sharded_state(state: RunState) -> dict:
    """Model and optimizer state by global parameter name (this rank's DTensor shards)."""
    return _sharded(state.model.named_parameters(), state.optimizer)


def _sharded(named: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer):
    return {"model": dict(named), "optim": {name: optimizer.state[p] for name, p in named}}


def checkpoint_payload(
    cfg: RunConfig,
    named: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    step: int,
    loader: dict[str, int],
    lr_anchor: Anchor | None,
    extra_meta: dict | None = None,
) -> tuple[dict, dict, dict, dict]:
    """What a checkpoint holds, as :meth:`CheckpointWriter.save` takes it: the shards by global
    name, the trainer state, the RNG and the metadata. ``boostlr import-hf`` writes its step-0
    checkpoint through this too, so an imported run resumes like any other."""
    trainer = {
        "step": step,
        "loader": loader,
        "lr_schedule": {"steps": cfg.train.steps, "anchor": lr_anchor},
    }
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    meta = {
        "config": to_dict(cfg),
        "layout": layout_of(cfg),
        "world_size": cfg.parallel.world_size,
        **(extra_meta or {}),
    }
    return _sharded(named, optimizer), trainer, rng, meta


def save(state: RunState, step: int) -> float:
    """Every rank writes its own shards (no gather); returns the seconds the loop blocked."""
    payload = checkpoint_payload(
        state.cfg,
        state.model.named_parameters(),
        state.optimizer,
        step,
        state.loader.state_dict(),
        state.lr_anchor,
    )
    return state.writer.save(step, *payload, {TOKENIZER_FILE: state.run_dir / TOKENIZER_FILE})
