"""Hugging Face model of boostlr's mixture-of-experts models (any arch), with KV cache.

Copied into every MoE export beside ``configuration_boostlr.py`` and ``modeling_boostlr.py``,
whose classes these subclass: the blocks from ``moe_dense_layers`` on get
:class:`BoostlrMoeMLP`, the earlier ones keep the dense MLP. It imports torch and
transformers only, so an export loads without boostlr; the router and the experts restate
boostlr's ``models/moe.py`` and ``moe_experts.py`` operation for operation, and the dispatch
(sort by expert, grouped GEMMs, combine; the capacity form) is boostlr's own
``moe_grouped.py``, copied beside this file, so the logits are boostlr's own forward's, and
the parameter names are boostlr's (``mlp.router.weight``, ``mlp.router.expert_bias``,
``mlp.experts.gate_proj.up.weight [E, f_e, r]``, ...), so the weights load by name. A dense
export does not carry this file.

Dispatch is boostlr's too: dropless (copies sorted by expert, every expert GEMM one grouped
call; padded where the widths or dtype do not fit the grouped kernel), or with
``moe_capacity > 0`` a fixed capacity per expert whose overflow is dropped,
as boostlr's forward drops it in evaluation as in training. Which copies drop then depends
on the tokens that share a forward (batch, padding, a KV cache's one-token steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_boostlr import (
    BoostlrColaMoeConfig,
    BoostlrConfig,
    BoostlrFullConfig,
    BoostlrLaxMoeConfig,
    BoostlrSvdMoeConfig,
)
from .modeling_boostlr import (
    BoostlrDecoderLayer,
    BoostlrForCausalLM,
    BoostlrLowRankLinear,
    BoostlrMLP,
    BoostlrModel,
    Latents,
    _get,
)
from .moe_grouped import (
    capacity_of,
    dropless,
    expert_product,
    grouped_widths_fit,
    run_experts,
    stacked_linear,
    top_k_copies,
    with_capacity,
)


class BoostlrRouter(nn.Module):
    """``W_r : d -> E`` in at least fp32, top-k, the picked weights normalised to sum to 1.

    ``bias`` balance: sigmoid scores, and the persistent ``expert_bias`` buffer (exported
    with the weights) shifts which experts are picked, not their weights. ``aux``: softmax.
    """

    def __init__(self, experts: int, top_k: int, dim: int, balance: str):
        super().__init__()
        self.top_k, self.balance = top_k, balance
        self.weight = nn.Parameter(torch.empty(experts, dim))
        if balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, weights)``, both ``[tokens, top_k]``."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        if self.balance == "bias":
            scores = torch.sigmoid(logits)
            idx = torch.topk(scores + self.expert_bias.to(dtype), self.top_k, dim=-1).indices
            normed = scores / scores.sum(-1, keepdim=True)
        else:
            normed = torch.softmax(logits, dim=-1)
            idx = torch.topk(normed, self.top_k, dim=-1).indices
        picked = normed.gather(-1, idx)
        return idx, picked / picked.sum(-1, keepdim=True)


class StackedFactor(nn.Module):
    """``n`` matrices ``d_in -> d_out`` as one ``weight [n, d_out, d_in]``."""

    def __init__(self, n: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in))

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """Every matrix on its sorted rows of ``x`` (``offs``), or batched/broadcast."""
        return stacked_linear(x, self.weight, offs)


class StackedLinear(nn.Module):
    """``n`` copies of one block linear: ``W x`` (``rank`` None), ``B σ(A x)`` or ``B A x``."""

    def __init__(self, n: int, d_in: int, d_out: int, rank: int | None, activation: bool):
        super().__init__()
        self.activation = activation
        self.widths = (d_in, d_out) if rank is None else (d_in, rank, d_out)
        if rank is None:
            self.weight = nn.Parameter(torch.empty(n, d_out, d_in))
        else:
            self.down = StackedFactor(n, d_in, rank)
            self.up = StackedFactor(n, rank, d_out)

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        if not hasattr(self, "down"):
            return stacked_linear(x, self.weight, offs)
        a = self.down(x, offs)
        return self.up(F.silu(a) if self.activation else a, offs)


def _run(experts: nn.Module, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``experts._compute`` grouped where the widths and dtype fit the grouped kernel, else
    padded (one read of the busiest expert's count)."""
    grouped = grouped_widths_fit(experts.widths, next(experts.parameters()).dtype)
    return run_experts(experts._compute, x, offs, grouped, lambda counts: int(counts.max()))


class WholeExperts(nn.Module):
    """``hidden`` dispatch: ``n`` whole MLPs of the arch, ``d -> f_e -> d`` each."""

    def __init__(self, n: int, dim: int, ffn: int, rank: int | None, activation: bool, form: str):
        super().__init__()
        self.form = form
        self.gate_proj = StackedLinear(n, dim, ffn, rank, activation)
        self.up_proj = StackedLinear(n, dim, ffn, rank, activation)
        self.down_proj = StackedLinear(n, ffn, dim, rank, activation)
        self.widths = self.gate_proj.widths + self.down_proj.widths

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        return _run(self, x, offs)

    def _compute(self, x: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        h = expert_product(self.gate_proj(x, offs), self.up_proj(x, offs), self.form)
        return self.down_proj(h, offs)


class _Part(nn.Module):
    """Holds one factor under the dense MLP's name for it (``gate_proj.up`` and so on)."""


class LatentExperts(nn.Module):
    """``latent`` dispatch: each expert's inner maps, ``z = [z_g | z_u] (2r) -> u (r)``:
    ``u = σ(A_d^e ((B_g^e z_g) ⊙ (B_u^e z_u)))`` (no σ for svd)."""

    def __init__(self, n: int, rank: int, ffn: int, activation: bool, form: str):
        super().__init__()
        self.rank, self.form, self.activation = rank, form, activation
        self.widths = (rank, ffn)
        self.gate_proj, self.up_proj, self.down_proj = _Part(), _Part(), _Part()
        self.gate_proj.up = StackedFactor(n, rank, ffn)  # B_g^e
        self.up_proj.up = StackedFactor(n, rank, ffn)  # B_u^e
        self.down_proj.down = StackedFactor(n, ffn, rank)  # A_d^e

    def forward(self, z: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        return _run(self, z, offs)

    def _compute(self, z: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        zg, zu = z[..., : self.rank].contiguous(), z[..., self.rank :].contiguous()
        h = expert_product(self.gate_proj.up(zg, offs), self.up_proj.up(zu, offs), self.form)
        a = self.down_proj.down(h, offs)
        return F.silu(a) if self.activation else a


class _SharedOut(nn.Module):
    """The MoE MLP's shared out-factor ``B_d`` (r -> d), named ``down_proj.up`` as in CoLA."""

    def __init__(self, config: BoostlrConfig):
        super().__init__()
        self.up = nn.Linear(config.rank, config.hidden_size, bias=False)


class BoostlrMoeMLP(nn.Module):
    """boostlr's mixture-of-experts MLP: routed top-k plus shared experts (weight 1).

    ``latent`` dispatch: ``z = [h(A_g x) | h(A_u x)]`` (the arch's latent, LaX's crossing
    included), experts map ``z`` to ``r`` wide outputs, one ``B_d`` maps their weighted sum.
    ``hidden``: every expert a whole MLP of the arch on the d-wide token. Under LaX the
    latents passed on are those of ``A_g`` and ``A_u``; ``down_proj`` has none.
    """

    def __init__(self, config: BoostlrConfig, layer: int):
        super().__init__()
        c, n, shared = config, config.moe_experts, config.moe_shared
        self.experts_n, self.capacity = n, config.moe_capacity
        self.latent = config.moe_dispatch == "latent"
        self.router = BoostlrRouter(n, c.moe_top_k, c.hidden_size, c.moe_balance)
        act, form, f = c.latent_activation, c.mlp_form, c.moe_ffn_dim
        if self.latent:
            self.gate_proj = BoostlrLowRankLinear(c, c.hidden_size, None, layer)  # A_g
            self.up_proj = BoostlrLowRankLinear(c, c.hidden_size, None, layer)  # A_u
            self.down_proj = _SharedOut(c)  # B_d
            self.experts: nn.Module = LatentExperts(n, c.rank, f, act, form)
            if shared:
                self.shared = LatentExperts(shared, c.rank, f, act, form)
        else:
            rank = c.rank if c.lowrank else None
            self.experts = WholeExperts(n, c.hidden_size, f, rank, act, form)
            if shared:
                self.shared = WholeExperts(shared, c.hidden_size, f, rank, act, form)

    def forward(self, x: torch.Tensor, z_prev: Latents | None) -> tuple[torch.Tensor, Latents]:
        lead = x.shape[:-1]
        tokens = x.reshape(-1, x.shape[-1])
        idx, weights = self.router(tokens)
        z: Latents = {}
        if self.latent:
            zg, z["gate_proj"] = self.gate_proj.latent(x, _get(z_prev, "gate_proj"))
            zu, z["up_proj"] = self.up_proj.latent(x, _get(z_prev, "up_proj"))
            payload = torch.cat([zg, zu], dim=-1).reshape(tokens.shape[0], -1)
        else:
            payload = tokens
        copies = top_k_copies(idx, weights)
        if self.capacity:
            cap = capacity_of(idx.shape[0], idx.shape[1], self.experts_n, self.capacity)
            out, _ = with_capacity(payload, *copies, self.experts_n, cap, self.experts)
        else:
            out = dropless(payload, *copies, self.experts_n, self.experts)
        if hasattr(self, "shared"):
            out = out + self.shared(payload, None).sum(0)
        if self.latent:
            out = self.down_proj.up(out)
        return out.reshape(*lead, -1), {k: v for k, v in z.items() if v is not None}


class BoostlrMoeDecoderLayer(BoostlrDecoderLayer):
    """A block whose MLP is :class:`BoostlrMoeMLP` from ``moe_dense_layers`` on."""

    @staticmethod
    def mlp_for(config: BoostlrConfig, layer: int) -> nn.Module:
        if layer >= config.moe_dense_layers:
            return BoostlrMoeMLP(config, layer)
        return BoostlrMLP(config, layer)


class BoostlrMoeModel(BoostlrModel):
    decoder_layer = BoostlrMoeDecoderLayer
    _no_split_modules = ["BoostlrMoeDecoderLayer"]


class BoostlrMoeForCausalLM(BoostlrForCausalLM):
    inner_model = BoostlrMoeModel
    _no_split_modules = ["BoostlrMoeDecoderLayer"]


# Each arch's base model (``AutoModel``, what vLLM builds) and causal LM, with the arch's config.
class BoostlrSvdMoeModel(BoostlrMoeModel):
    config_class = BoostlrSvdMoeConfig


class BoostlrColaMoeModel(BoostlrMoeModel):
    config_class = BoostlrColaMoeConfig


class BoostlrLaxMoeModel(BoostlrMoeModel):
    config_class = BoostlrLaxMoeConfig


class BoostlrFullMoeModel(BoostlrMoeModel):
    config_class = BoostlrFullConfig


class BoostlrSvdMoeForCausalLM(BoostlrMoeForCausalLM):
    config_class = BoostlrSvdMoeConfig
    inner_model = BoostlrSvdMoeModel


class BoostlrColaMoeForCausalLM(BoostlrMoeForCausalLM):
    config_class = BoostlrColaMoeConfig
    inner_model = BoostlrColaMoeModel


class BoostlrLaxMoeForCausalLM(BoostlrMoeForCausalLM):
    config_class = BoostlrLaxMoeConfig
    inner_model = BoostlrLaxMoeModel


class BoostlrFullMoeForCausalLM(BoostlrMoeForCausalLM):
    config_class = BoostlrFullConfig
    inner_model = BoostlrFullMoeModel


MOE_MODEL_CLASSES = {
    "svd": BoostlrSvdMoeForCausalLM,
    "cola": BoostlrColaMoeForCausalLM,
    "lax": BoostlrLaxMoeForCausalLM,
    "full": BoostlrFullMoeForCausalLM,
}
MOE_BASE_MODEL_CLASSES = {
    "svd": BoostlrSvdMoeModel,
    "cola": BoostlrColaMoeModel,
    "lax": BoostlrLaxMoeModel,
    "full": BoostlrFullMoeModel,
}
