"""The routing map: what a router hands the dispatch of an MoE layer.

A router (:mod:`boostlr.models.moe_router`) turns a micro-batch's normed tokens into a
:class:`Routing`: its routed copies as three flat tensors (which token, which expert, with
what weight), in priority order, and the scores the balance loss averages. A dispatcher
(:mod:`boostlr.models.moe_dispatch`, :mod:`boostlr.parallel.expert_parallel`) reads only the
copies: it sorts them by expert, runs the experts and sums each copy's weighted result into
its token, and never assumes a fixed number of copies per token. So a router of another
kind (expert choice, node-limited top-k) is a module of its own returning the same map.

This module imports torch only, as the dispatch math does, so an export can carry both
beside its remote code (which runs without boostlr).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
