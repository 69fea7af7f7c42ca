"""The block's MLP behind one interface: what the block builds and the TP strategies act on.

A strategy reaches an MLP's linears by their role, never by attribute name: the linears that
``read`` the normed residual, the local ``combine`` between them, and the one linear that
``writes`` the residual (:class:`~boostlr.models.shapes.MlpLinears`). Megatron makes the
readers column-parallel and the writer row-parallel, vanilla TP splits each one's rank, BTP
folds the norm into the readers' grouped down-projection. An MLP of another shape (a mixture
of experts) is a new class with its own ``kind``, built by :func:`make_mlp`; a strategy
states the kinds it runs (``MLP_KINDS`` in its runtime module) and refuses any other one by
name when the model is built (:mod:`boostlr.parallel.strategies`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.models.lowrank import BlockLinear, make_linear
from boostlr.models.moe import make_moe_mlp
from boostlr.models.shapes import GATED_MLP, MlpLinears, linear_shapes

Latents = dict[str, torch.Tensor]

#: The kind of :class:`GatedMLP`.
GATED = "gated"


def mlp_product(gate: torch.Tensor, up: torch.Tensor, form: str) -> torch.Tensor:
    """``silu(g) ⊙ u`` (SwiGLU) or ``g ⊙ u`` (CoLA's low-rank-only MLP: σ sits in the linears)."""
    return F.silu(gate) * up if form == "swiglu" else gate * up


class GatedMLP(nn.Module):
    """``down(combine(gate(x), up(x)))``: LLaMA's SwiGLU, or CoLA's low-rank-only MLP.

    The linears keep HF LLaMA's attribute names (``gate_proj``, ``up_proj``, ``down_proj``),
    so parameter names, checkpoints and exports are those of the dense model.
    """

    kind = GATED
    linears: MlpLinears = GATED_MLP

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | str | None):
        super().__init__()
        self.form = cfg.mlp_form
        shapes = linear_shapes(cfg)
        for name in self.linears.names:
            d_in, d_out = shapes[name]
            setattr(self, name, make_linear(cfg, d_in, d_out, layer, device))

    def readers(self) -> list[tuple[str, BlockLinear]]:
        """The linears reading the normed residual, with their names (ledger tags, latents)."""
        return [(name, getattr(self, name)) for name in self.linears.reads]

    def writer(self) -> tuple[str, BlockLinear]:
        """The linear writing the residual, with its name."""
        name = self.linears.writes
        return name, getattr(self, name)

    def combine(self, *outs: torch.Tensor) -> torch.Tensor:
        """The local step from the readers' outputs to the writer's input."""
        gate, up = outs
        return mlp_product(gate, up, self.form)

    def forward(self, x: torch.Tensor, z_prev: Latents | None) -> tuple[torch.Tensor, Latents]:
        """The single-device math; ``z`` holds each linear's LaX latent by its name."""
        z: Latents = {}
        outs = []
        for name, lin in self.readers():
            out, z[name] = lin(x, None if z_prev is None else z_prev.get(name))
            outs.append(out)
        name, lin = self.writer()
        y, z[name] = lin(self.combine(*outs), None if z_prev is None else z_prev.get(name))
        return y, z


class BlockMLP(Protocol):
    """What every MLP kind offers: its ``kind`` (which strategies run it, see
    :mod:`boostlr.parallel.strategies`) and the single-device math, ``(y, latents)``."""

    kind: str

    def __call__(self, x: torch.Tensor, z_prev: Latents | None) -> tuple[torch.Tensor, Latents]: ...


def make_mlp(cfg: ModelConfig, layer: int, device: torch.device | str | None) -> BlockMLP:
    """Block ``layer``'s MLP: the one place that picks an MLP kind for a config (the MoE
    MLP in a block :func:`~boostlr.models.moe.make_moe_mlp` makes one for, else gated)."""
    moe = make_moe_mlp(cfg, layer, device)
    return moe if moe is not None else GatedMLP(cfg, layer, device)


def gated(mlp: nn.Module, strategy: str) -> GatedMLP:
    """``mlp`` as a :class:`GatedMLP`, or a ``ValueError`` naming ``strategy`` and its kind."""
    if not isinstance(mlp, GatedMLP):
        kind = getattr(mlp, "kind", type(mlp).__name__)
        raise ValueError(f"tp strategy {strategy!r} runs only a {GATED!r} MLP, not a {kind!r} one")
    return mlp
