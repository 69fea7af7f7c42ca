"""Which slice of each single-device parameter a tensor-parallel rank holds.

A sharded model keeps the single-device module tree and parameter names; each parameter is
replaced by its contiguous chunk along one dim (``ShardSpec.dim``) or kept whole
(``dim=None``, replicated), as the strategy's rule in :mod:`boostlr.models.placement` says.
Because names and split dims are explicit, the full model can be rebuilt from any layout
(checkpoints, export, gradient checks) and a sharded run starts from exactly the slices of
the seeded single-device weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from boostlr.models.placement import chunk_range
from boostlr.parallel.collectives import GroupComm


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


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's chunk of ``full`` (a copy)."""
    if spec.dim is None:
        return full.clone()
    start, end = chunk_range(full.shape[spec.dim], rank, tp)
    return full.narrow(spec.dim, start, end - start).clone()


def unshard_tensor(
    local: torch.Tensor, spec: ShardSpec, full_size: int | None, comm: GroupComm
) -> torch.Tensor:
    """All-gather the chunks back to the single-device tensor.

    Not recorded in the ledger: it serves checkpoints and tests, not the training step.
    """
    if spec.dim is None or comm.size == 1:
        return local.detach().clone()
    step = -(-full_size // comm.size)
    pad = step - local.shape[spec.dim]
    chunk = local.detach()
    if pad:  # all_gather needs equal sizes: pad the short chunks, cut the padding after
        pad_shape = list(local.shape)
        pad_shape[spec.dim] = pad
        chunk = torch.cat([chunk, chunk.new_zeros(pad_shape)], dim=spec.dim)
    parts = [torch.empty_like(chunk) for _ in range(comm.size)]
    dist.all_gather(parts, chunk.contiguous(), group=comm.group)
    return torch.cat(parts, dim=spec.dim).narrow(spec.dim, 0, full_size)


def shard_module(
    model: nn.Module, specs: dict[str, ShardSpec], rank: int, tp: int
) -> dict[str, torch.Size]:
    """Replace every parameter by its shard in place; returns the full shapes by name.

    A parameter shared by several modules (tied embeddings) is sharded once and the same
    new parameter is put back in every place, so the tie survives.
    """
    full_shapes: dict[str, torch.Size] = {}
    replaced: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in replaced:
            full_shapes[name] = param.shape
            shard = shard_tensor(param.data, specs[name], rank, tp)
            replaced[id(param)] = nn.Parameter(shard, requires_grad=param.requires_grad)
        owner, attr = _owner(model, name)
        setattr(owner, attr, replaced[id(param)])
    return full_shapes


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
