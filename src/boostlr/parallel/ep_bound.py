"""What an expert-parallel rank may receive: a bound decided alike on every rank, or a
capacity in fixed shapes (docs/moe.md, "A bound on what a rank receives").

Dropless dispatch lets one rank receive up to ``ep · T · k`` routed copies when its experts
are hot; that rank would run out of memory while its peers wait in the next all-to-all.
So the counts are all-gathered (each rank then holds the whole ``[source, destination,
local expert]`` matrix) and every rank computes, from that same matrix, every
``(source, destination, expert)`` cell's quota under the bound: senders and receivers agree
on every split size by construction, with no further collective. Within a cell a sender
keeps its first copies in the capacity path's priority (first choices before second ones,
earlier tokens before later) and drops the rest (counted).

A capacity at ``ep > 1`` needs no counts at all: each rank gives each expert ``capacity``
slots for its own tokens (the single-device capacity path's slots, per source rank), so the
all-to-all moves a fixed ``[ep, E/ep, capacity, width]`` buffer: no host sync, fixed shapes
(``train.compile`` compiles it once).
"""

from __future__ import annotations

import torch

from boostlr.models.moe_dispatch import ExpertFn, capacity_of, expert_counts
from boostlr.parallel.collectives import GroupComm, all_to_all_single


def receive_cap(matrix: torch.Tensor, factor: float) -> torch.Tensor:
    """Rows one rank may receive: ``ceil(factor ·`` the group's copies per rank ``)``, a 0-d
    int64 device tensor, computed from the gathered ``matrix`` (so equal on every rank;
    ``factor · T · k`` when every rank routes ``T`` tokens)."""
    ep = matrix.shape[0]
    mean = matrix.sum().to(torch.float64) / ep
    return torch.ceil(mean * factor).to(torch.int64)


def receive_quota(matrix: torch.Tensor, cap: torch.Tensor | None) -> torch.Tensor:
    """Copies kept per cell of ``matrix [source, destination, local expert]``: what each
    destination receives summed to at most ``cap`` (all of it when it fits).

    Max-min fair per destination (water-filling): cells under a common level keep all
    their copies, the others are cut to the level, ``floor((cap - kept whole) / cut
    cells)``. Integer arithmetic on the device, so every rank finds the same quotas.
    """
    if cap is None:
        return matrix
    ep, _, per = matrix.shape
    cells = matrix.permute(1, 0, 2).reshape(ep, ep * per)  # [destination, source · expert]
    n = cells.shape[1]
    ascending = torch.sort(cells, dim=1).values
    smaller = torch.cumsum(ascending, 1) - ascending  # sum of the cells before each one
    left = torch.arange(n, 0, -1, device=cells.device)  # cells from each one on
    # Rows received if every cell were cut at this cell's count: non-decreasing.
    need = smaller + left * ascending
    whole = (need <= cap).sum(1, keepdim=True)  # the smallest cells, kept whole
    at = whole.clamp(max=n - 1)
    level = (cap - smaller.gather(1, at)) // left[at]
    level = torch.where(whole == n, cap, level)  # it all fits: no cut
    kept = torch.minimum(cells, level)
    return kept.view(ep, ep, per).permute(1, 0, 2)


def priority_positions(idx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each copy's place among its expert's copies, in the capacity path's priority
    (first choices before second ones, within a choice in token order); ``[k · tokens]``,
    choice-major (copy ``j · tokens + t`` is token ``t``'s choice ``j``).

    A stable sort, not a ``[k · tokens, E]`` one-hot cumulative sum: the same places.
    """
    by_choice = idx.t().reshape(-1)
    order = torch.argsort(by_choice, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(by_choice.numel(), device=idx.device) - starts[by_choice[order]]
    return torch.empty_like(order).scatter_(0, order, place)


def bounded_order(idx: torch.Tensor, counts: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """The copies (token-major flat indices) grouped by expert, token order kept, with
    expert ``e``'s first ``quota[e]`` in priority kept and the dropped ones after all kept.

    When nothing drops it is ``argsort(idx.reshape(-1), stable=True)``: the dropless order.
    """
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    place = priority_positions(idx, counts).view(k, tokens).t().reshape(-1)
    kept = place < quota[flat]
    return torch.argsort(torch.where(kept, flat, counts.numel()), stable=True)


def capacity_slots(
    idx: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot, kept)`` per copy, choice-major: copy's row in an ``[E · capacity]`` buffer
    (``E · capacity``, one spare row, for a dropped copy), as the single-device capacity
    path places it."""
    experts = counts.numel()
    place = priority_positions(idx, counts)
    kept = place < capacity
    by_choice = idx.t().reshape(-1)
    return torch.where(kept, by_choice * capacity + place, experts * capacity), kept


def capacity_ep(
    payload: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: int,
    fn: ExpertFn,
    comm: GroupComm,
    factor: float,
    tag: str = "moe",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_capacity`` (:mod:`boostlr.models.moe_dispatch`) with expert ``e`` on ep rank
    ``e // (E / ep)``: returns ``(combined, dropped)``.

    The capacity is per source rank and expert, ``ceil(factor · T · k / E)`` for this rank's
    ``T`` tokens: the slots, and so the drops, are exactly those of the single-device path
    run on this rank's tokens (dp at ep 1). Every rank of the group must route the same
    ``T`` (the trainer's micro-batches, training and evaluation, all have one shape), so
    the chunks are equal on every rank without exchanging anything.

    The ``[E, capacity, width]`` buffer is already ``[ep, E/ep, capacity, width]``: one
    all-to-all of equal, fixed chunks, the local experts run batched on
    ``[E/ep, ep · capacity, width]``, and the reverse all-to-all brings the results back to
    their slots. No counts cross and nothing is read to the host.
    """
    tokens, k = idx.shape
    ep, per = comm.size, experts // comm.size
    capacity = capacity_of(tokens, k, experts, factor)
    slot, kept = capacity_slots(idx, expert_counts(idx, experts), capacity)
    token = torch.arange(tokens, device=idx.device).repeat(k)
    rows = payload.new_zeros(experts * capacity + 1, payload.shape[-1])
    rows = rows.index_add(0, slot, payload[token])[:-1]
    chunk = [per * capacity] * ep
    arrived = all_to_all_single(rows, chunk, chunk, comm, tag)  # [source, expert, slot]
    local = arrived.view(ep, per, capacity, -1).transpose(0, 1).reshape(per, ep * capacity, -1)
    ran = fn(local, None)
    back = ran.view(per, ep, capacity, -1).transpose(0, 1).reshape(experts * capacity, -1)
    out = all_to_all_single(back, chunk, chunk, comm, tag)
    out = torch.cat([out, out.new_zeros(1, out.shape[-1])])
    w = weights.t().reshape(-1).to(out.dtype)
    combined = out.new_zeros(tokens, out.shape[-1])
    combined = combined.index_add(0, token, out[slot] * w.unsqueeze(-1))
    return combined, (~kept).sum()
