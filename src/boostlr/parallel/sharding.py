"""Which slice of each single-device parameter a tensor-parallel rank holds.

A sharded model keeps the single-device module tree and parameter names; each parameter is
replaced by its contiguous chunk along one dim (``ShardSpec.dim``) or kept whole
(``dim=None``, replicated), as the strategy's rule in :mod:`boostlr.models.placement` says.
Because names and split dims are explicit, the full model can be rebuilt from any layout
(checkpoints, export, gradient checks) and a sharded run starts from exactly the slices of
the seeded single-device weights: :func:`shard_box` says which slice a rank draws
(:mod:`boostlr.parallel.build`), so no rank ever holds a whole parameter to cut it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boostlr.models.placement import chunk_range


@dataclass(frozen=True)
class ShardSpec:
    """``dim=None``: replicated; otherwise split along ``dim`` in ``torch.chunk`` order.

    Chunks are ``ceil(n / tp)`` long (the last ones shorter, possibly empty), which is how
    DTensor's ``Shard`` splits: a vocabulary that ``tp`` does not divide keeps its global
    shape, so nothing about a tensor's identity depends on the layout.
    """

    dim: int | None


def shard_box(
    shape: torch.Size | tuple[int, ...], spec: ShardSpec, rank: int, tp: int
) -> list[tuple[int, int]]:
    """``(start, end)`` per dim of rank's chunk of a tensor of ``shape``: what it initialises."""
    box = [(0, n) for n in shape]
    if spec.dim is not None:
        box[spec.dim] = chunk_range(shape[spec.dim], rank, tp)
    return box
