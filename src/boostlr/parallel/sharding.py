"""Which slice of each single-device parameter a tensor-parallel rank holds.

A sharded model keeps the single-device module tree and parameter names; each parameter is
replaced by its contiguous chunk along one dim (``ShardSpec.dim``) or kept whole
(``dim=None``, replicated). Because names and split dims are explicit, the full model can be
rebuilt from any layout (checkpoints, export, gradient checks) and a sharded run starts from
exactly the slices of the seeded single-device weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from boostlr.parallel.collectives import GroupComm


@dataclass(frozen=True)
class ShardSpec:
    """``dim=None``: replicated. ``padded``: size of ``dim`` after padding to a multiple of TP."""

    dim: int | None
    padded: int | None = None


REPLICATED = ShardSpec(None)


def padded_size(size: int, tp: int) -> int:
    return -(-size // tp) * tp


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's chunk (zero-padded along ``spec.dim`` first when ``spec.padded`` is set)."""
    if spec.dim is None:
        return full.clone()
    if spec.padded is not None and spec.padded > full.shape[spec.dim]:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    if full.shape[spec.dim] % tp:
        raise ValueError(f"dim {spec.dim} of shape {tuple(full.shape)} does not split over {tp}")
    return full.chunk(tp, dim=spec.dim)[rank].clone()


def unshard_tensor(
    local: torch.Tensor, spec: ShardSpec, full_size: int | None, comm: GroupComm
) -> torch.Tensor:
    """All-gather the chunks back to the single-device tensor (drops vocab padding).

    Not recorded in the ledger: it serves checkpoints and tests, not the training step.
    """
    if spec.dim is None or comm.size == 1:
        full = local.detach().clone()
    else:
        parts = [torch.empty_like(local) for _ in range(comm.size)]
        dist.all_gather(parts, local.detach().contiguous(), group=comm.group)
        full = torch.cat(parts, dim=spec.dim)
    if spec.dim is not None and full_size is not None:
        full = full.narrow(spec.dim, 0, full_size)
    return full


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
