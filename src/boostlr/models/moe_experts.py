"""The experts of a mixture-of-experts MLP: ``n`` copies of some linears, stacked.

Every expert weight is one ``[n, d_out, d_in]`` parameter rather than ``n`` modules, for three
reasons: expert parallelism shards it as a DTensor ``Shard(0)`` over the ep ranks, so
distributed checkpoints reshard the expert dimension like any other; the experts run as one
grouped GEMM per factor over the rows sorted by expert (or one batched GEMM over an
``[n, capacity, d_in]`` buffer), never one expert at a time; and a checkpoint has a handful of
keys per layer, not a handful per expert. The math is written once
(:func:`boostlr.hf.moe_grouped.stacked_linear`): grouped over sorted rows with their
offsets, batched, or broadcast for the shared experts.

Names mirror the dense MLP's (``gate_proj.down`` is A of gate_proj, ``.up`` its B), so the
checkpoint keys read like the dense model's with an expert dimension in front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from boostlr.config import ModelConfig
from boostlr.hf.moe_grouped import product_linear, run_experts, stacked_linear
from boostlr.models.lowrank import cola_std
from boostlr.models.moe_dispatch import grouped_here, host_max
from boostlr.models.params import forward_dtype, local
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import ROUTER, is_moe_layer


class StackedFactor(nn.Module):
    """``n`` matrices ``d_in -> d_out`` as one ``weight [n, d_out, d_in]``."""

    def __init__(self, n: int, d_in: int, d_out: int, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in, device=device))

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """Every matrix on its rows of ``x [rows, d_in]`` (sorted, ending at ``offs``);
        ``offs=None``: batched (``x [n, .., d_in]``) or broadcast (``x [tokens, d_in]`` gives
        ``[n, tokens, d_out]``)."""
        return stacked_linear(x, local(self.weight), offs)


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
        self.widths = (d_in, d_out) if rank is None else (d_in, rank, d_out)
        if rank is None:
            self.weight = nn.Parameter(torch.empty(n, d_out, d_in, device=device))
        else:
            self.down = StackedFactor(n, d_in, rank, device)  # A: d_in -> r
            self.up = StackedFactor(n, rank, d_out, device)  # B: r -> d_out

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        return self._after_first(stacked_linear(x, self._first(), offs), offs)

    def on_product(
        self, gate: torch.Tensor, up: torch.Tensor, form: str, offs: torch.Tensor | None
    ) -> torch.Tensor:
        """``forward(expert_product(gate, up, form))`` with the product not kept for the
        backward (:func:`~boostlr.hf.moe_grouped.product_linear`): the experts' widest
        activation, ``[copies, f_e]``, is recomputed there instead."""
        return self._after_first(product_linear(gate, up, self._first(), offs, form), offs)

    def _first(self) -> torch.Tensor:
        """The factor that takes the input: ``W``, or ``A`` of ``B σ(A x)`` (its local shard
        under DTensor)."""
        return local(self.down.weight if hasattr(self, "down") else self.weight)

    def _after_first(self, a: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """What follows the first factor: nothing for ``W``, ``B σ(·)`` for a low-rank one."""
        if not hasattr(self, "down"):
            return a
        return self.up(F.silu(a) if self.activation else a, offs)


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
        self.widths = self.gate_proj.widths + self.down_proj.widths

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """The experts on ``x [rows, d]`` sorted by expert (``offs``), or on a batched or
        broadcast ``x`` (see :class:`StackedFactor`): d wide."""
        grouped = _grouped(self, self.widths)
        return run_experts(self._compute, x, offs, grouped, host_max)

    def _compute(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.gate_proj(x, offs), self.up_proj(x, offs)
        return self.down_proj.on_product(gate, up, self.form, offs)


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
        self.widths = (r, f)
        self.gate_proj, self.up_proj, self.down_proj = _Part(), _Part(), _Part()
        self.gate_proj.up = StackedFactor(n, r, f, device)  # B_g^e
        self.up_proj.up = StackedFactor(n, r, f, device)  # B_u^e
        self.down_proj.down = StackedFactor(n, f, r, device)  # A_d^e

    def forward(self, z: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """The experts on ``z [rows, 2r]`` sorted by expert (``offs``), or on a batched or
        broadcast ``z`` (see :class:`StackedFactor`): r wide."""
        grouped = _grouped(self, self.widths)
        return run_experts(self._compute, z, offs, grouped, host_max)

    def _compute(self, z: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        # The halves as their own contiguous rows (the grouped kernel wants aligned strides).
        zg, zu = z[..., : self.rank].contiguous(), z[..., self.rank :].contiguous()
        gate, up = self.gate_proj.up(zg, offs), self.up_proj.up(zu, offs)
        a = product_linear(gate, up, local(self.down_proj.down.weight), offs, self.form)
        return F.silu(a) if self.activation else a


def _grouped(experts: nn.Module, widths: tuple[int, ...]) -> bool:
    """Whether ``experts`` run grouped: decided by their weights' device and the dtype the
    forward computes in (the autocast dtype under autocast; no weight is cast to ask)."""
    weight = next(experts.parameters())
    weight = weight.to_local() if isinstance(weight, DTensor) else weight
    return grouped_here(weight.device, forward_dtype(weight), widths)


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
