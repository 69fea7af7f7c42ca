"""Seeded initial values, one parameter at a time, keyed by the parameter's name.

Each parameter draws from its own generator seeded from ``(seed, name)``, so its value does
not depend on which other parameters exist on a rank: a pipeline stage or a tensor-parallel
shard is initialised by drawing only its own parameters (one full tensor at a time) and
slicing, and equals the single-device model's init for the same seed exactly.
"""

from __future__ import annotations

import hashlib

import torch

from boostlr.config import ModelConfig
from boostlr.models.lowrank import cola_std
from boostlr.models.shapes import linear_shapes


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed that is the same on every machine, process and torch version."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _linear_of(name: str) -> str:
    """``layers.3.mlp.up_proj.down.weight`` -> ``up_proj``."""
    parts = name.split(".")
    return parts[3] if len(parts) > 3 and parts[0] == "layers" else ""


def initial_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The single-device initial value of parameter ``name`` (full shape, fp32, CPU)."""

    def normal(std: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(parameter_seed(seed, name))
        return torch.randn(shape, generator=gen) * std

    if name.endswith("norm.weight"):  # RMSNorm gains, LaX's LN_r included
        return torch.ones(shape)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return normal(cfg.init_std)
    if ".cross." in name:
        # The gate's output starts at zero, so a fresh LaX model equals CoLA with LN_r; the
        # factored gate's first half is random so gradients reach both halves.
        if name.endswith("cross.gate_down.weight"):
            return normal(cola_std(cfg.rank, cfg.rank, cfg.lax_gate_rank))
        return torch.zeros(shape)
    if name.endswith((".down.weight", ".up.weight")):
        d_in, d_out = linear_shapes(cfg)[_linear_of(name)]
        return normal(cola_std(d_in, d_out, cfg.rank))
    if _linear_of(name):
        return normal(cfg.init_std)  # a dense block linear
    raise ValueError(f"no initialisation rule for parameter {name!r}")
