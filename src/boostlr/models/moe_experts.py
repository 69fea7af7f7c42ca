"""The experts of a mixture-of-experts MLP: ``n`` copies of some linears, stacked.

Every expert weight is one ``[n, d_out, d_in]`` parameter rather than ``n`` modules, for three
reasons: expert parallelism shards it as a DTensor ``Shard(0)`` over the ep ranks, so
distributed checkpoints reshard the expert dimension like any other; a fixed-capacity
dispatch runs all experts as one batched GEMM; and a checkpoint has a handful of keys per
layer, not a handful per expert. One expert's weights are ``weight[e]``; the math is written
once with ``matmul``'s broadcasting, so the same code applies one expert to its ``[tokens,
d_in]`` slice, or all of them to an ``[n, capacity, d_in]`` buffer.

Names mirror the dense MLP's (``gate_proj.down`` is A of gate_proj, ``.up`` its B), so the
checkpoint keys read like the dense model's with an expert dimension in front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.models.lowrank import cola_std
from boostlr.models.params import local
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import ROUTER, is_moe_layer


def expert_product(gate: torch.Tensor, up: torch.Tensor, form: str) -> torch.Tensor:
    """``silu(g) ⊙ u`` (swiglu) or ``g ⊙ u`` (lowrank-only), as the dense MLP's product.

    Restated rather than imported from :mod:`boostlr.models.llama`, which builds blocks from
    this package: importing it here would make a circle.
    """
    return F.silu(gate) * up if form == "swiglu" else gate * up


class StackedFactor(nn.Module):
    """``n`` matrices ``d_in -> d_out`` as one ``weight [n, d_out, d_in]``."""

    def __init__(self, n: int, d_in: int, d_out: int, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in, device=device))

    def forward(self, x: torch.Tensor, e: int | None) -> torch.Tensor:
        """Matrix ``e`` on ``x [..., d_in]``; ``e=None``: all ``n``, batched (``x [n, ..]``)
        or broadcast (``x [tokens, d_in]`` gives ``[n, tokens, d_out]``)."""
        return torch.matmul(x, local(self.weight, e).mT)


class StackedLinear(nn.Module):
    """``n`` copies of one block linear of the arch: ``W x``, ``B σ(A x)`` or ``B A x``."""

    def __init__(
        self,
        n: int,
        d_in: int,
        d_out: int,
        rank: int | None,
        activation: bool,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.activation = activation
        if rank is None:
            self.weight = nn.Parameter(torch.empty(n, d_out, d_in, device=device))
        else:
            self.down = StackedFactor(n, d_in, rank, device)  # A: d_in -> r
            self.up = StackedFactor(n, rank, d_out, device)  # B: r -> d_out

    def forward(self, x: torch.Tensor, e: int | None) -> torch.Tensor:
        if not hasattr(self, "down"):
            return torch.matmul(x, local(self.weight, e).mT)
        a = self.down(x, e)
        return self.up(F.silu(a) if self.activation else a, e)


class WholeExperts(nn.Module):
    """``hidden`` dispatch: ``n`` whole MLPs of the arch, ``d -> f_e -> d`` each."""

    def __init__(self, cfg: ModelConfig, n: int, device: torch.device | str | None = None):
        super().__init__()
        d, f = cfg.dim, cfg.moe_ffn_dim
        rank = cfg.rank if cfg.lowrank else None
        act = latent_sigma(cfg)
        self.form = cfg.mlp_form
        self.gate_proj = StackedLinear(n, d, f, rank, act, device)
        self.up_proj = StackedLinear(n, d, f, rank, act, device)
        self.down_proj = StackedLinear(n, f, d, rank, act, device)

    def forward(self, x: torch.Tensor, e: int | None) -> torch.Tensor:
        """Expert ``e`` on ``x [tokens, d]`` (or all, see :class:`StackedFactor`): d wide."""
        h = expert_product(self.gate_proj(x, e), self.up_proj(x, e), self.form)
        return self.down_proj(h, e)


class _Part(nn.Module):
    """Holds one factor under the dense MLP's name for it (``gate_proj.up`` and so on)."""


class LatentExperts(nn.Module):
    """``latent`` dispatch: each expert's inner maps, ``z = [z_g | z_u] (2r) -> u (r)``.

    ``h = (B_g^e z_g) ⊙ (B_u^e z_u)`` (or ``silu(B_g^e z_g) ⊙ ...`` for the swiglu form) and
    ``u = σ(A_d^e h)`` (no σ for svd): the outer factors ``A_g, A_u, B_d`` are the layer's,
    shared by every expert (docs/moe.md).
    """

    def __init__(self, cfg: ModelConfig, n: int, device: torch.device | str | None = None):
        super().__init__()
        r, f = cfg.rank, cfg.moe_ffn_dim
        self.rank, self.form, self.activation = r, cfg.mlp_form, latent_sigma(cfg)
        self.gate_proj, self.up_proj, self.down_proj = _Part(), _Part(), _Part()
        self.gate_proj.up = StackedFactor(n, r, f, device)  # B_g^e
        self.up_proj.up = StackedFactor(n, r, f, device)  # B_u^e
        self.down_proj.down = StackedFactor(n, f, r, device)  # A_d^e

    def forward(self, z: torch.Tensor, e: int | None) -> torch.Tensor:
        """Expert ``e`` on ``z [tokens, 2r]`` (or all, see :class:`StackedFactor`): r wide."""
        zg, zu = z[..., : self.rank], z[..., self.rank :]
        h = expert_product(self.gate_proj.up(zg, e), self.up_proj.up(zu, e), self.form)
        a = self.down_proj.down(h, e)
        return F.silu(a) if self.activation else a


def latent_sigma(cfg: ModelConfig) -> bool:
    """Whether the arch's factors have σ between them: CoLA's SiLU, LaX's σ after its
    crossing; svd has none (``A`` then ``B``, a product of two linear maps)."""
    return arch_spec(cfg.arch).latent_activation


def moe_init_rule(cfg: ModelConfig, name: str) -> float | str | None:
    """The init std of a MoE layer's parameter ``name`` (a global name, ``layers.{i}.mlp.*``);
    ``None`` when the name is not a MoE parameter or the dense rules apply (LaX's crossing).

    Each factor takes CoLA's std of the expert-sized linear it belongs to (``d -> f_e`` for
    gate and up, ``f_e -> d`` for down), the shared outer factors included; the router and
    dense experts take ``init_std``.
    """
    parts = name.split(".")
    if len(parts) < 5 or parts[0] != "layers" or parts[2] != "mlp":
        return None
    if not is_moe_layer(cfg, int(parts[1])) or ".cross." in name:
        return None
    if parts[3] == ROUTER:
        return cfg.init_std
    linear = next((p for p in parts if p.endswith("_proj")), None)
    if linear is None:
        raise ValueError(f"no initialisation rule for MoE parameter {name!r}")
    if parts[-2] not in ("down", "up"):
        return cfg.init_std  # a dense (arch full) expert linear
    d, f = cfg.dim, cfg.moe_ffn_dim
    d_in, d_out = (f, d) if linear == "down_proj" else (d, f)
    return cola_std(d_in, d_out, cfg.rank)
