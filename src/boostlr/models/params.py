"""Parameter access that works for plain tensors and for DTensor-wrapped shards.

In a distributed run every parameter is a DTensor (its global shape and split dim,
docs/design.md §4) while the forward is the hand-written per-rank math: it reads the local shard.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local(p: Tensor) -> Tensor:
    """This rank's tensor of ``p`` (``p`` itself when it is not a DTensor)."""
    return p.to_local() if isinstance(p, DTensor) else p
