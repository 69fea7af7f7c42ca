"""The router of an MoE layer: what the layer asks of one, and the top-k router.

A router turns a micro-batch's normed tokens into a routing map
(:class:`~boostlr.models.moe_routing.Routing`) that the layer's dispatch runs. What the layer,
its runtimes (BTP computes the logits row-parallel) and its step hooks ask of a router is
:class:`Router`; :class:`TopKRouter` is the top-k router: each token picks ``moe_top_k``
experts, scored as its balance says (:class:`boostlr.specs.moe.BalanceSpec`). A router of
another kind (expert choice, node-limited top-k) is a module of its own beside it
(docs/extending.md, "An MoE router").
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.models.moe_routing import Routing, top_k_routing
from boostlr.models.params import forward_dtype, local
from boostlr.specs.moe import BIAS_BUFFER, LOAD_BUFFER, BalanceSpec, balance_spec


class Router(Protocol):
    """What the MoE layer, its runtimes and its step hooks ask of a router module.

    ``weight [E, d]``: the logits' weight, which BTP applies row-parallel to the d-sharded
    residual before calling ``select``; ``forward(x)`` is ``select`` of ``x``'s logits (in at
    least fp32). ``balance``: its :class:`~boostlr.specs.moe.BalanceSpec`; with a
    ``selection_bias`` the router holds the bias buffer (:data:`~boostlr.specs.moe.BIAS_BUFFER`)
    that :func:`boostlr.models.moe.update_expert_biases` moves. ``load [E]`` int64: the
    copies per expert since the last bias update (the layer adds to it).
    """

    weight: nn.Parameter
    balance: BalanceSpec
    load: torch.Tensor

    def __call__(self, x: torch.Tensor) -> Routing: ...

    def select(self, logits: torch.Tensor) -> Routing: ...


class TopKRouter(nn.Module):
    """``W_r : d -> E`` on the normed token, top-k, weights summing to 1.

    Logits and scores are computed in at least fp32 whatever the autocast dtype, so a
    routing decision is not made on bf16 ties; the input is kept for the backward in the
    compute dtype (:class:`_RouterLogits`), not as an fp32 copy. Under a balance with a
    ``selection_bias``, the bias is a persistent buffer: in the state dict and checkpoints,
    never trained by autograd. ``load`` counts the copies each expert was sent since the
    last bias update (training forwards only; not saved).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        self.top_k, self.balance = cfg.moe_top_k, balance_spec(cfg.moe_balance)
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.dim, device=device))
        if self.balance.selection_bias:
            self.register_buffer(BIAS_BUFFER, torch.zeros(cfg.moe_experts, device=device))
        self.register_buffer(
            LOAD_BUFFER, torch.zeros(cfg.moe_experts, dtype=torch.int64, device=device), False
        )

    def forward(self, x: torch.Tensor) -> Routing:
        return self.select(_RouterLogits.apply(x, local(self.weight), forward_dtype(x)))

    def select(self, logits: torch.Tensor) -> Routing:
        """The routing from logits ``[tokens, E]`` (BTP computes them row-parallel)."""
        if self.balance.sigmoid_scores:
            scores = torch.sigmoid(logits)
            normed = scores / scores.sum(-1, keepdim=True)
        else:
            scores = normed = torch.softmax(logits, dim=-1)
        if self.balance.selection_bias:
            scores = scores + self.expert_bias.to(logits.dtype)
        idx = torch.topk(scores, self.top_k, dim=-1).indices
        picked = normed.gather(-1, idx)
        return top_k_routing(idx, picked / picked.sum(-1, keepdim=True), normed)


class _RouterLogits(torch.autograd.Function):
    """``x W_r^T`` in at least fp32 (from ``x`` as it arrives), keeping ``x`` for the backward
    in the compute dtype ``keep``: under bf16 the router holds a bf16 ``[T, d]`` (often ``x``
    itself), not an fp32 copy of it. The weight gradient, like every weight gradient of a bf16
    run, is then a product of bf16-rounded activations, accumulated in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, keep: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        dtype = torch.promote_types(x.dtype, torch.float32)
        ctx.save_for_backward(x.to(keep), w)
        ctx.x_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), w.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        dtype, gx, gw = grad.dtype, None, None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                gx = (grad @ w.to(dtype)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                flat = x.reshape(-1, x.shape[-1]).to(dtype)
                gw = (grad.reshape(-1, grad.shape[-1]).t() @ flat).to(w.dtype)
        return gx, gw, None
