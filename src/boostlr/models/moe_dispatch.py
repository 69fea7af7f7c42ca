"""Sending routed token copies to their experts and combining the results, on one device.

Both forms compute ``out[t] = Σ_j w[t, j] · expert_{idx[t, j]}(payload[t])`` for the ``k``
choices ``j`` of each token ``t``:

- :func:`dropless` sorts the copies by expert and runs each expert on its contiguous slice.
  The slice sizes must be known on the host: :func:`host_counts` is the one device-to-host
  copy per MoE layer and micro-batch (the price of having no dropped tokens; expert
  parallelism needs the same counts to size its all-to-all buffers).
- :func:`with_capacity` gives every expert ``capacity`` rows of one ``[E, capacity, width]``
  buffer: fixed shapes, no host sync, one batched GEMM per factor; the copies past an
  expert's capacity are dropped (they add nothing) and counted.

The payload is whatever the dispatch carries (the d-wide token, or the 2r-wide latent).

Expert parallelism routes through :class:`Dispatch`, a function of :func:`dropless`'s
signature that the parallel engine gives the layer (:mod:`boostlr.parallel.expert_parallel`):
the model imports nothing from the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ExpertFn = Callable[[torch.Tensor, "int | None"], torch.Tensor]
#: ``(payload, idx, weights, experts, fn) -> (combined, dropped)``: :func:`dropless`'s
#: arguments, and the copies it dropped (0-d int64 on the device).
Dispatch = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, ExpertFn], tuple[torch.Tensor, torch.Tensor]
]


def host_counts(counts: torch.Tensor) -> list[int]:
    """Per-expert copy counts on the host: dropless dispatch's one device-to-host copy.

    Kept in this one function so it is the only place the MoE layer waits for the device
    (tests/test_moe_model.py counts its calls).
    """
    return counts.tolist()


def expert_counts(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Routed copies per expert, ``[experts]`` int64 on the device.

    A scatter-add, not ``torch.bincount``: on CUDA bincount reads the largest index back to
    size its output, a host sync this layer must not add.
    """
    flat = idx.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=idx.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def dropless(
    payload: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: int,
    fn: ExpertFn,
) -> torch.Tensor:
    """Every copy computed: sort by expert, one call of ``fn(slice, e)`` per expert.

    Every expert runs, on an empty slice if it got no copies, so every expert parameter gets
    a gradient (zero) in every step whatever the routing.
    """
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # copies grouped by expert, token order kept
    token = order // k
    sizes = host_counts(expert_counts(idx, experts))
    chunks = payload[token].split(sizes)
    out = torch.cat([fn(chunk, e) for e, chunk in enumerate(chunks)])
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    combined = out.new_zeros(payload.shape[0], out.shape[-1])
    return combined.index_add(0, token, out)


def capacity_of(tokens: int, k: int, experts: int, factor: float) -> int:
    """Rows per expert at capacity factor ``factor``: ``ceil(factor · tokens · k / E)``."""
    return max(1, math.ceil(factor * tokens * k / experts))


def with_capacity(
    payload: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: int,
    capacity: int,
    fn: ExpertFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed shapes: each expert takes at most ``capacity`` copies; returns (combined, dropped).

    Copies are served first choices first, then second choices and so on, and within a
    choice in token order (GShard's priority), so which copies are dropped is a fixed
    function of the routing. ``dropped`` is a 0-d int64 device tensor (no sync).
    """
    tokens, k = idx.shape
    by_choice = idx.t().reshape(-1)  # [k * tokens]: all first choices, then all second ...
    token = torch.arange(tokens, device=idx.device).repeat(k)
    one_hot = torch.nn.functional.one_hot(by_choice, experts)
    position = (one_hot.cumsum(0) - 1).gather(1, by_choice.unsqueeze(1)).squeeze(1)
    kept = position < capacity
    # Dropped copies go to one spare row past the experts' rows: no expert reads it, and it
    # reads back as zeros, so a dropped copy adds nothing (and its weight gets no gradient).
    row = torch.where(kept, by_choice * capacity + position, experts * capacity)
    rows = payload.new_zeros(experts * capacity + 1, payload.shape[-1])
    rows = rows.index_add(0, row, payload[token])
    out = fn(rows[:-1].view(experts, capacity, -1), None).reshape(experts * capacity, -1)
    out = torch.cat([out, out.new_zeros(1, out.shape[-1])])
    w = weights.t().reshape(-1).to(out.dtype)
    combined = out.new_zeros(tokens, out.shape[-1])
    combined = combined.index_add(0, token, out[row] * w.unsqueeze(-1))
    return combined, (~kept).sum()
