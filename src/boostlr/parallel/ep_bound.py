"""What an expert-parallel rank may receive: a bound decided alike on every rank, or a
capacity in fixed shapes (docs/moe.md, "A bound on what a rank receives").

Dropless dispatch lets one rank receive up to ``ep · T · k`` routed copies when its experts
are hot; that rank would run out of memory while its peers wait in the next all-to-all.
So the counts are all-gathered (each rank then holds the whole ``[source, destination,
local expert]`` matrix) and every rank computes, from that same matrix, every
``(source, destination, expert)`` cell's quota under the bound: senders and receivers agree
on every split size by construction, with no further collective. Within a cell a sender
keeps its first copies in the routing map's priority order (the top-k router's: first
choices before second ones, earlier tokens before later) and drops the rest (counted).

A capacity at ``ep > 1`` needs no counts at all: each rank gives each expert ``capacity``
slots for its own tokens (the single-device capacity path's slots, per source rank), so the
all-to-all moves a fixed ``[ep, E/ep, capacity, width]`` buffer: no host sync, fixed shapes
(``train.compile`` compiles it once).
"""

from __future__ import annotations

import torch

from boostlr.hf.moe_grouped import combine, queue_positions
from boostlr.models.moe_dispatch import ExpertFn, expert_counts
from boostlr.models.moe_routing import Routing
from boostlr.parallel.collectives import GroupComm, all_to_all_single
from boostlr.specs.moe import capacity_of


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


def bounded_order(expert: torch.Tensor, counts: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """The map's copies grouped by expert (the map's order kept within an expert), with
    expert ``e``'s first ``quota[e]`` in priority kept and the dropped ones after all kept.

    When nothing drops it is ``argsort(expert, stable=True)``: the dropless order.
    """
    kept = queue_positions(expert, counts) < quota[expert]
    return torch.argsort(torch.where(kept, expert, counts.numel()), stable=True)


def capacity_slots(
    expert: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot, kept)`` per copy of the map: its row in an ``[E · capacity]`` buffer
    (``E · capacity``, one spare row, for a dropped copy), as the single-device capacity
    path places it."""
    experts = counts.numel()
    place = queue_positions(expert, counts)
    kept = place < capacity
    return torch.where(kept, expert * capacity + place, experts * capacity), kept


def capacity_ep(
    payload: torch.Tensor,
    route: Routing,
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
    tokens = route.tokens
    k = route.copies // max(1, tokens)  # copies per token (top-k: k)
    ep, per = comm.size, experts // comm.size
    capacity = capacity_of(tokens, k, experts, factor)
    slot, kept = capacity_slots(route.expert, expert_counts(route.expert, experts), capacity)
    rows = payload.new_zeros(experts * capacity + 1, payload.shape[-1])
    rows = rows.index_add(0, slot, payload[route.token])[:-1]
    chunk = [per * capacity] * ep
    arrived = all_to_all_single(rows, chunk, chunk, comm, tag)  # [source, expert, slot]
    local = arrived.view(ep, per, capacity, -1).transpose(0, 1).reshape(per, ep * capacity, -1)
    ran = fn(local, None)
    back = ran.view(per, ep, capacity, -1).transpose(0, 1).reshape(experts * capacity, -1)
    out = all_to_all_single(back, chunk, chunk, comm, tag)
    out = torch.cat([out, out.new_zeros(1, out.shape[-1])])
    return combine(out[slot], route.weight, route.token, payload.shape[0]), (~kept).sum()
