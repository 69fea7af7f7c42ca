"""Parameter access that works for plain tensors and for DTensor-wrapped shards.

In a distributed run every parameter is a DTensor (its global shape and split dim,
docs/design.md §4) while the forward is the hand-written per-rank math: it reads the local shard.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def local(p: Tensor) -> Tensor:
    """This rank's tensor of ``p`` (``p`` itself when it is not a DTensor), as the forward
    uses it: under autocast, its copy in the autocast dtype.

    Every forward reads its parameters through here, so every parameter is used as a bf16
    copy under bf16 whatever the layout (docs/precision.md): FSDP's mixed precision hands
    bf16 copies to the units it gathers at dp > 1, and this cast does the same where nothing
    gathers (dp 1, the vocabulary tables split over dp). The fp32 master stays what the
    optimizer updates; its gradient is accumulated in fp32.
    """
    t = p.to_local() if isinstance(p, DTensor) else p
    return in_dtype(t, forward_dtype(t))


def in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: itself when it already is. ``t.to(dtype)`` returns its input then
    too, but still costs the host a dispatch (an op a step pays on every call, and the plan
    charges: ``specs.strategy.host_ops_per_kernel``)."""
    return t if t.dtype == dtype else t.to(dtype)


def forward_dtype(t: Tensor) -> torch.dtype:
    """The dtype :func:`local` hands ``t`` to the forward in, without casting it."""
    device = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype
