"""Tests only: a tensor-parallel rank's shards cut from whole single-device tensors.

The trainer never holds a whole parameter: :mod:`boostlr.parallel.build` draws each shard by
itself. The TP tests do hold whole ones. They give a model built by ``build_stages`` weights
of their own choosing (moved off the init, or the reference model's current weights) and
compare gradients slice by slice, so the slicing lives here, beside them, in the same
``torch.chunk`` order as DTensor's ``Shard`` (:func:`boostlr.models.placement.chunk_range`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from boostlr.config import RunConfig
from boostlr.models.placement import chunk_range
from boostlr.parallel.build import build_stages
from boostlr.parallel.context import TPContext
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.sharding import ShardSpec
from boostlr.parallel.tensor_parallel import TensorParallelModel

CPU = torch.device("cpu")


def built(cfg: RunConfig, comms: MeshComms) -> ParallelModel:
    """This rank's model as the trainer builds it (``ParallelModel.build``), on ``comms``:
    tests share one mesh over many configs of the same layout instead of making one each."""
    return ParallelModel(cfg, comms, build_stages(cfg, comms, CPU, comms.pp.rank), CPU)


def shard_tensor(full: Tensor, spec: ShardSpec, rank: int, tp: int) -> Tensor:
    """Rank ``rank``'s chunk of ``full`` (a copy)."""
    if spec.dim is None:
        return full.clone()
    start, end = chunk_range(full.shape[spec.dim], rank, tp)
    return full.narrow(spec.dim, start, end - start).clone()


def stage_of(model: ParallelModel, name: str) -> TensorParallelModel:
    """The stage of ``model`` that holds parameter ``name``."""
    return next(part for part in model.stages if name in part.specs)


def shard_of(model: ParallelModel, name: str, full: Tensor) -> Tensor:
    """This rank's tensor-parallel chunk of ``full``, the whole value of parameter ``name``."""
    part = stage_of(model, name)
    return shard_tensor(full, part.specs[name], part.ctx.comm.rank, part.ctx.comm.size)


def local_grad(p: Tensor) -> Tensor:
    """This rank's gradient of ``p`` as a plain tensor."""
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def _like(p: Tensor, shard: Tensor) -> Tensor:
    """``shard`` as ``p`` holds its value: a DTensor with ``p``'s placement, or plain."""
    if not isinstance(p, DTensor):
        return shard
    return DTensor.from_local(
        shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def load_full(
    model: ParallelModel,
    weights: dict[str, Tensor],
    grads: dict[str, Tensor] | None = None,
) -> None:
    """Set every parameter to its shard of the whole ``weights`` (and ``grads``, else none).

    Local: every rank slices the same whole tensors, so no collective is needed.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            shard = shard_of(model, name, weights[name])
            (p.to_local() if isinstance(p, DTensor) else p).copy_(shard)
            p.grad = None if grads is None else _like(p, shard_of(model, name, grads[name]))


def full_grads(model: ParallelModel) -> dict[str, Tensor]:
    """Every gradient at its single-device shape (a collective over the TP ranks)."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def sliced(model: nn.Module, strategy: str | None, ctx: TPContext) -> TensorParallelModel:
    """``model`` (a whole single-device one) sliced in place to ``ctx``'s rank, wrapped.

    Plain tensors, not DTensors. A parameter shared by several modules (tied embeddings) is
    sliced once and the same new parameter put back in every place, so the tie survives.
    """
    part = TensorParallelModel(model, strategy, ctx)
    rank, tp = ctx.comm.rank, ctx.comm.size
    replaced: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in replaced:
            shard = shard_tensor(param.data, part.specs[name], rank, tp)
            replaced[id(param)] = nn.Parameter(shard, requires_grad=param.requires_grad)
        path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(path) if path else model, attr, replaced[id(param)])
    return part
