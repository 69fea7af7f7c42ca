"""What a checkpoint holds, built from a model's named parameters and its optimizer.

The trainer saves a running model through :func:`checkpoint_payload`, and ``boostlr
import-hf`` writes its step-0 checkpoint through it too, so an imported run resumes like
any other.
"""

from __future__ import annotations

import torch

from boostlr.config import RunConfig, to_dict
from boostlr.platform import rng_states

# The learning-rate schedule's anchor, (step, lr), as :mod:`boostlr.train.optim` keeps it.
Anchor = tuple[int, float]


def layout_of(cfg: RunConfig) -> dict:
    """The layout a checkpoint was written at (``meta.json``'s ``layout``)."""
    p = cfg.parallel
    layout = {
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
        "strategy": p.strategy_for(cfg.model.arch),
        "stages_per_rank": p.virtual_stages,
        "dp_mode": p.data_parallel_mode if p.dp > 1 else None,
    }
    if p.ep > 1:  # only then: a dense or ep 1 checkpoint's meta is what it was
        layout["ep"] = p.ep
    return layout


def sharded(
    named: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    buffers: list[tuple[str, torch.Tensor]] | None = None,
) -> dict:
    """Model and optimizer state by global parameter name (this rank's DTensor shards).

    ``buffers`` (an MoE router's balance bias: whole, equal on every rank) join the model
    state by their global names; a dense model has none, so its key set is unchanged.
    """
    model = {**dict(named), **dict(buffers or [])}
    return {"model": model, "optim": {name: optimizer.state[p] for name, p in named}}


def checkpoint_payload(
    cfg: RunConfig,
    named: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    step: int,
    loader: dict[str, int],
    lr_anchor: Anchor | None,
    extra_meta: dict | None = None,
    buffers: list[tuple[str, torch.Tensor]] | None = None,
) -> tuple[dict, dict, dict, dict]:
    """What a checkpoint holds, as :meth:`CheckpointWriter.save` takes it: the shards by global
    name, the trainer state, the RNG and the metadata."""
    trainer = {
        "step": step,
        "loader": loader,
        "lr_schedule": {"steps": cfg.train.steps, "anchor": lr_anchor},
    }
    rng = rng_states()
    meta = {
        "config": to_dict(cfg),
        "layout": layout_of(cfg),
        "world_size": cfg.parallel.world_size,
        **(extra_meta or {}),
    }
    return sharded(named, optimizer, buffers), trainer, rng, meta
