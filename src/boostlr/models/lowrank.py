"""The seven block linears of every arch behind one interface, and :func:`make_linear`.

Each linear maps ``(x, z_prev) -> (y, z)``: ``z`` is the latent LaX hands to the same linear of
the next block (``None`` for the other archs). Low-rank linears expose their two halves
separately (``down`` = A, ``latent`` = the rank-r nonlinearity, ``up`` = B) because
Bottleneck-aware TP puts a collective *between* them: it reuses these pieces instead of
re-implementing the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.models.norm import RMSNorm
from boostlr.models.params import local
from boostlr.specs.arch import DENSE, LAX, LOWRANK, arch_spec


def cola_std(d_in: int, d_out: int, rank: int) -> float:
    """CoLA's factor init: ``randn * r^(-1/4) * (d_in + d_out)^(-1/4)``."""
    return rank**-0.25 * (d_in + d_out) ** -0.25


class DenseLinear(nn.Module):
    """Full-rank ``W x`` (arch ``full``); parameter named ``weight`` as in HF LLaMA."""

    def __init__(self, d_in: int, d_out: int, device: torch.device | str | None = None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device))

    def forward(
        self, x: torch.Tensor, z_prev: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        return F.linear(x, local(self.weight)), None


class LowRankLinear(nn.Module):
    """``B σ(A x)`` (CoLA, σ = SiLU) or ``B A x`` (SVD, no activation)."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        activation: bool,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.d_in, self.d_out, self.rank = d_in, d_out, rank
        self.activation = activation
        self.down = nn.Linear(d_in, rank, bias=False, device=device)  # A: d_in -> r
        self.up = nn.Linear(rank, d_out, bias=False, device=device)  # B: r -> d_out

    def latent(
        self, a: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank-r nonlinearity applied to ``a = A x``; returns (σ input's image, LaX latent)."""
        return (F.silu(a) if self.activation else a), None

    def forward(
        self, x: torch.Tensor, z_prev: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, z = self.latent(F.linear(x, local(self.down.weight)), z_prev)
        return F.linear(h, local(self.up.weight)), z


class LatentCrossing(nn.Module):
    """LaX's ``LN_r(a + G(z_prev))``; block 0 has the norm but no gate ``G``."""

    def __init__(
        self,
        rank: int,
        gate: str | None,
        gate_rank: int,
        eps: float,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.norm = RMSNorm(rank, eps, device=device)
        self.gate_kind = gate
        if gate == "factored":
            self.gate_down = nn.Linear(rank, gate_rank, bias=False, device=device)
            self.gate_up = nn.Linear(gate_rank, rank, bias=False, device=device)
        elif gate is not None:  # "full": one r x r map
            self.gate = nn.Linear(rank, rank, bias=False, device=device)

    def forward(
        self, a: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        u = a
        if self.gate_kind is not None:
            if z_prev is None:
                raise ValueError("LaX crossing with a gate needs the previous block's latent")
            if self.gate_kind == "factored":
                inner = F.linear(z_prev, local(self.gate_down.weight))
                u = u + F.linear(inner, local(self.gate_up.weight))
            else:
                u = u + F.linear(z_prev, local(self.gate.weight))
        return self.norm(u), u


class LaxLinear(LowRankLinear):
    """``B σ(LN_r(A x + G(z_prev)))``: the latent ``z = A x + G(z_prev)`` crosses blocks."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        gate: str | None,
        gate_rank: int,
        eps: float,
        device: torch.device | str | None = None,
    ):
        super().__init__(d_in, d_out, rank, activation=True, device=device)
        self.cross = LatentCrossing(rank, gate, gate_rank, eps, device=device)

    def latent(
        self, a: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, z = self.cross(a, z_prev)
        return F.silu(normed), z


BlockLinear = DenseLinear | LowRankLinear


def make_linear(
    cfg: ModelConfig, d_in: int, d_out: int, layer: int, device: torch.device | str | None
) -> BlockLinear:
    """The block linear of ``cfg.arch``, built by its spec's linear kind (no arch names)."""
    spec = arch_spec(cfg.arch)
    if spec.linear == DENSE:
        return DenseLinear(d_in, d_out, device=device)
    if spec.linear == LAX:
        gate = cfg.lax_gate if layer > 0 else None
        return LaxLinear(
            d_in, d_out, cfg.rank, gate, cfg.lax_gate_rank, cfg.norm_eps, device=device
        )
    if spec.linear == LOWRANK:
        return LowRankLinear(
            d_in, d_out, cfg.rank, activation=spec.latent_activation, device=device
        )
    raise ValueError(f"arch {spec.name!r}: no block linear of kind {spec.linear!r}")
