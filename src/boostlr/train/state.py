"""What a rank trains (:class:`RunState`) and how it goes into and out of a checkpoint.

The step loop in :mod:`boostlr.train.loop` advances a RunState; this module saves one through
the checkpoint format of :mod:`boostlr.rundir` (this rank's shards by global name) and
restores it at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from boostlr.config import RunConfig, from_dict
from boostlr.data import BatchLoader
from boostlr.models.moe import checkpointed_buffers
from boostlr.parallel.engine import ParallelModel
from boostlr.platform import set_rng_states
from boostlr.rundir.checkpoint import Checkpoint, load_sharded_state, load_trainer_state
from boostlr.rundir.layout import TOKENIZER_FILE
from boostlr.rundir.payload import checkpoint_payload, sharded
from boostlr.rundir.timeouts import checkpoint_collectives
from boostlr.rundir.writer import CheckpointWriter, SaveStats
from boostlr.train.memory import MemoryPhases
from boostlr.train.optim import Anchor, lr_at, reanchor
from boostlr.train.stopping import StopCheck


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
    stop: StopCheck | None = None  # asked at the end of every step: save and stop early?

    @property
    def distributed(self) -> bool:
        return self.model.comms.mesh is not None

    def lr(self, step: int) -> float:
        return lr_at(step, self.cfg.train, self.lr_anchor)


def restore(state: RunState, ckpt: Checkpoint) -> None:
    """Weights, AdamW moments, data position, RNG and schedule — at any layout."""
    writer = state.writer  # loads wait on the writer's group, sized as for its saves
    with checkpoint_collectives(writer.timeout_s):
        load_sharded_state(ckpt, sharded_state(state), writer.group)
    trainer, rng = load_trainer_state(ckpt, state.rank)
    state.loader.load_state_dict(trainer["loader"])
    set_rng_states(rng)
    state.start_step = ckpt.step
    schedule = trainer.get("lr_schedule") or {}
    anchor = tuple(schedule["anchor"]) if schedule.get("anchor") else None
    saved_train = from_dict(ckpt.meta["config"]).train
    state.lr_anchor = reanchor(saved_train, anchor, state.cfg.train, ckpt.step)


def sharded_state(state: RunState) -> dict:
    """Model and optimizer state by global parameter name (this rank's DTensor shards)."""
    return sharded(state.model.named_parameters(), state.optimizer, saved_buffers(state))


def saved_buffers(state: RunState) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (MoE balance biases), by global name."""
    return [b for part in state.model.stages for b in checkpointed_buffers(part.model)]


def save(state: RunState, step: int) -> SaveStats:
    """Every rank writes its own shards (no gather); returns what the save cost."""
    payload = checkpoint_payload(
        state.cfg,
        state.model.named_parameters(),
        state.optimizer,
        step,
        state.loader.state_dict(),
        state.lr_anchor,
        buffers=saved_buffers(state),
    )
    return state.writer.save(step, *payload, {TOKENIZER_FILE: state.run_dir / TOKENIZER_FILE})
