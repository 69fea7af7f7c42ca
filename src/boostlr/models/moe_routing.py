"""The router -> dispatcher -> experts chain of an MoE layer: the routing map, and the router.

A router turns a micro-batch's normed tokens into a :class:`Routing`: its routed copies as
three flat tensors (which token, which expert, with what weight), in priority order, and
the scores the balance loss averages. A dispatcher (:mod:`boostlr.models.moe_dispatch`,
:mod:`boostlr.parallel.expert_parallel`) reads only the copies: it sorts them by expert,
runs the experts and sums each copy's weighted result into its token, and never assumes a
fixed number of copies per token. So a router of another kind (expert choice, node-limited
top-k) is a module of its own returning the same map; the MoE layer
(:class:`boostlr.models.moe.MoEMLP`), its dispatchers and its metrics stay as they are.

What the layer asks of a router is :class:`Router`; :class:`TopKRouter` is the top-k
router: each token picks ``moe_top_k`` experts, scored as its balance says
(:class:`boostlr.specs.moe.BalanceSpec`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.models.params import local
from boostlr.specs.moe import BIAS_BUFFER, LOAD_BUFFER, BalanceSpec, balance_spec


class Routing(NamedTuple):
    """A micro-batch's routing map.

    ``token``, ``expert``, ``weight`` (``[copies]`` each): routed copy ``c`` sends token
    ``token[c]`` to expert ``expert[c]`` and adds its result with weight ``weight[c]``. The
    copies are listed in priority order: a capacity serves each expert's copies in it, and
    drops the rest. ``scores [tokens, E]``: the affinities normalised over the experts
    (what the balance loss averages); its rows are the micro-batch's tokens.
    """

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    scores: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.scores.shape[0]

    @property
    def copies(self) -> int:
        return self.expert.shape[0]


def top_k_routing(idx: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor) -> Routing:
    """The map of each token's ``k`` choices ``idx, weights [tokens, k]``, in GShard's
    priority: every token's first choice (in token order), then every second choice, ..."""
    tokens, k = idx.shape
    token = torch.arange(tokens, device=idx.device).repeat(k)
    return Routing(token, idx.t().reshape(-1), weights.t().reshape(-1), scores)


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
    routing decision is not made on bf16 ties. Under a balance with a ``selection_bias``,
    the bias is a persistent buffer: in the state dict and checkpoints, never trained by
    autograd. ``load`` counts the copies each expert was sent since the last bias update
    (training forwards only; not saved).
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
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), local(self.weight).to(dtype))
        return self.select(logits)

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
