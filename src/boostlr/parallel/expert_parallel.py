"""Expert parallelism: the routed experts spread over the ``ep`` group (docs/moe.md).

:func:`shard_experts` keeps each ep rank's ``E / ep`` experts as ``Shard(0)`` DTensors and
gives every MoE layer :func:`dropless_ep` (under ``parallel.ep_receive_factor``'s bound) or,
with a capacity, :func:`~boostlr.parallel.ep_bound.capacity_ep` as its dispatch: each
routed copy travels to its expert's owner by an all-to-all over ``ep`` and its result comes
back by the reverse one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from boostlr.hf.moe_grouped import combine
from boostlr.models.moe import moe_layers
from boostlr.models.moe_dispatch import ExpertFn, expert_counts, host_counts
from boostlr.models.moe_routing import Routing
from boostlr.parallel.collectives import (
    GroupComm,
    all_to_all_single,
    gather_counts,
)
from boostlr.parallel.ep_bound import bounded_order, capacity_ep, receive_cap, receive_quota
from boostlr.parallel.mesh import EXPERT_DIMS, MeshComms
from boostlr.specs.moe import is_routed_expert


def dropless_ep(
    payload: torch.Tensor,
    route: Routing,
    experts: int,
    fn: ExpertFn,
    comm: GroupComm,
    tag: str = "moe",
    receive_factor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dropless`` (:mod:`boostlr.models.moe_dispatch`) with expert ``e`` on ep rank
    ``e // (E / ep)``: the same sum, computed where the experts live, and the copies
    dropped (0-d int64; none without a bound).

    The ``[ep, E / ep]`` counts go first (a fixed-shape all-gather: every rank then knows
    what every rank sends where), then the payload. With ``receive_factor > 0`` no rank
    receives more than ``ceil(receive_factor · T · k)`` rows: every rank computes the same
    quotas from the same gathered counts (:mod:`boostlr.parallel.ep_bound`), so the split
    sizes agree by construction; the copies past a quota are dropped (the map's later
    copies first: later choices, then later tokens). The copies, sorted by expert, are
    already grouped by owner; what arrives is grouped by source rank, then expert, and the
    local experts run on it as one grouped call (:func:`run_received`). The results go back
    by the reverse all-to-all, and weighting and summing happen at the token's own rank, as
    in ``dropless``. An expert that got nothing has an empty group (its weight gradient is
    zero).
    """
    ep = comm.size
    per = experts // ep
    counts = expert_counts(route.expert, experts)
    matrix = gather_counts(counts.view(ep, per), comm, tag)  # [source, destination, expert]
    cap = receive_cap(matrix, receive_factor) if receive_factor else None
    quota = receive_quota(matrix, cap)
    mine = quota[comm.rank]
    incoming = quota[:, comm.rank]  # [source, local expert], on the device
    # The one device-to-host copy: what this rank sends, and what it receives.
    both = host_counts(torch.cat([mine.reshape(-1), incoming.reshape(-1)]))
    sent, got = both[: ep * per], both[ep * per :]
    send = [sum(sent[j * per : (j + 1) * per]) for j in range(ep)]
    recv = [sum(got[j * per : (j + 1) * per]) for j in range(ep)]
    if cap is None:
        order = torch.argsort(route.expert, stable=True)
    else:
        order = bounded_order(route.expert, counts, mine.reshape(-1))[: sum(send)]
    token = route.token[order]
    arrived = all_to_all_single(payload[token], send, recv, comm, tag)
    back = run_received(arrived, incoming, fn)
    out = all_to_all_single(back, recv, send, comm, tag)
    combined = combine(out, route.weight[order], token, payload.shape[0])
    return combined, counts.sum() - mine.sum()


def run_received(arrived: torch.Tensor, incoming: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
    """The local experts on the rows that arrived, as one grouped call; the results in
    arrival order (by source rank, then local expert: what the reverse all-to-all sends).

    ``incoming [ep, E / ep]`` (on the device) counts each source's rows per local expert:
    the rows are sorted by local expert once and the offsets are their running sums, so
    nothing here reads the counts back (the one host copy is the all-to-all's sizes).
    """
    sources, per = incoming.shape
    ids = torch.arange(sources * per, device=incoming.device) % per
    expert = torch.repeat_interleave(ids, incoming.reshape(-1), output_size=arrived.shape[0])
    order = torch.argsort(expert, stable=True)
    offs = incoming.sum(0).cumsum(0).to(torch.int32)
    ran = fn(arrived[order], offs)
    return ran.new_zeros(ran.shape).index_copy(0, order, ran)


def expert_rows(experts: int, ep: GroupComm) -> tuple[int, int]:
    """The rows ``[start, end)`` of the expert dimension this ep rank holds."""
    per = experts // ep.size
    return ep.rank * per, (ep.rank + 1) * per


def as_expert_dtensor(shard: torch.Tensor, comms: MeshComms, shape: torch.Size) -> DTensor:
    """This ep rank's rows of a stacked ``[E, ...]`` weight, as ``Shard(0)`` on ``ep``."""
    stride = torch.empty(shape, device="meta").stride()
    mesh = comms.dim_mesh("ep")
    return DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def use_expert_parallel(model: nn.Module, ep: GroupComm, receive_factor: float = 0.0) -> None:
    """Give every MoE layer in ``model`` the all-to-all dispatch over ``ep``: the capacity
    one (fixed shapes) under ``model.moe_capacity``, else dropless, bounded by
    ``receive_factor`` (``parallel.ep_receive_factor``; 0: unbounded)."""
    for layer in moe_layers(model):
        if layer.capacity:
            layer.dispatch = functools.partial(capacity_ep, comm=ep, factor=layer.capacity)
        else:
            layer.dispatch = functools.partial(dropless_ep, comm=ep, receive_factor=receive_factor)


def shard_experts(model: nn.Module, comms: MeshComms, receive_factor: float = 0.0) -> None:
    """Keep this ep rank's ``E / ep`` routed experts of every MoE layer in ``model``, as
    DTensors ``Shard(0)`` on the ``ep`` sub-mesh, and send the layers' copies to them.

    For a model built whole and alike on every rank (tests; the trainer draws only its rows,
    :func:`boostlr.parallel.build.materialize`). Shared experts stay whole on every rank.
    """
    ep = comms.ep
    if ep.size == 1:
        return
    for layer in moe_layers(model):
        for name, param in list(layer.experts.named_parameters()):
            start, end = expert_rows(param.shape[0], ep)
            value = as_expert_dtensor(param.detach()[start:end].clone(), comms, param.shape)
            path, _, attr = name.rpartition(".")
            owner = layer.experts.get_submodule(path) if path else layer.experts
            setattr(owner, attr, nn.Parameter(value, requires_grad=param.requires_grad))
    use_expert_parallel(model, ep, receive_factor)


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, comms: MeshComms) -> None:
    """Make each expert shard's gradient the dp mean, as FSDP makes the others'.

    The all-to-all's backward has already summed the ep group's contributions into the
    shard's owner. Over ``dp_rep > 1`` the experts are FSDP units of their own
    (:func:`boostlr.parallel.data_parallel.shard_experts_over_dp`): their reduce-scatter sums
    the replicas and divides by dp, and nothing is left here. At ``dp_rep = 1`` (``ep = dp``)
    the ep group is the whole dp group: only the division by dp is left, no collective.
    Call once per step, after the last backward and before clipping.
    """
    if comms.ep.size == 1 or comms.group("dp_rep").size > 1:
        return
    for name, param in model.named_parameters():  # a few stacked weights per layer
        if is_routed_expert(name) and param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.div_(comms.dp.size)


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by DTensor mesh (plain tensors together), in order."""
    groups: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(i)
    return list(groups.values())


def clip_grads_with_norm(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_`` for gradients on several meshes: one call per mesh.

    The fused (foreach) scaling takes every gradient in one op, which DTensor refuses across
    meshes; the scale factor is the same for all of them. On one mesh it is one call, as before.
    """
    for group in _by_mesh([p.grad for p in params]):
        torch.nn.utils.clip_grads_with_norm_([params[i] for i in group], max_norm, norm)


@dataclass(frozen=True)
class FlatGroup:
    """A group that holds exactly the ranks of a multi-dim mesh whose dims' groups are
    ``dims``: the ``dp`` group and the experts' ``dp_rep x ep`` unflattening of it, the same
    ranks by construction (:func:`~boostlr.parallel.mesh.unflatten_experts`)."""

    group: dist.ProcessGroup
    dims: tuple[dist.ProcessGroup, ...]


def experts_flat_group(comms: MeshComms) -> FlatGroup | None:
    """The ``dp`` group as the flat form of the experts' ``dp_rep x ep`` mesh (``ep > 1``)."""
    if comms.ep.size <= 1:
        return None
    return FlatGroup(comms.dp.group, tuple(comms.group(d).group for d in EXPERT_DIMS))


def total_grad_norm(grads: list[torch.Tensor], flat: FlatGroup | None = None) -> torch.Tensor:
    """The L2 norm of gradients that live on several meshes (FSDP's ``dp``, the experts'
    ``ep``), as a plain 0-d tensor.

    ``get_total_norm`` stacks its per-tensor norms, which DTensor refuses across meshes; so
    each mesh's gradients are normed together (a DTensor norm resolved over its mesh: an
    ep shard's experts counted once), then those norms are. On one mesh it is that mesh's
    norm, the same value as before there were two.

    ``flat``: the experts' 2-D ``dp_rep x ep`` mesh as one group (:func:`experts_flat_group`).
    Gradients on that mesh sharded over both dims (each element on one rank) are then normed
    by one all-reduce of the squared local norm there, where DTensor runs one all-reduce per
    mesh dim, one after the other.
    """
    norms = []
    for group in _by_mesh(grads):
        tensors = [grads[i] for i in group]
        if _sharded_over_flat(tensors, flat):
            local = torch.nn.utils.get_total_norm([t.to_local() for t in tensors], 2.0)
            square = local.float().pow(2).reshape(1)
            dist.all_reduce(square, group=flat.group)
            norms.append(square.sqrt().to(local.dtype).reshape(()))
            continue
        norm = torch.nn.utils.get_total_norm(tensors, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, 2.0)


def _sharded_over_flat(tensors: list[torch.Tensor], flat: FlatGroup | None) -> bool:
    """Whether ``tensors`` are DTensors on ``flat``'s mesh (each dim's group holds the ranks
    of ``flat.dims``' in the same order), every one sharded on every dim (each element held
    by exactly one rank).

    Decided from the mesh's process groups, never its rank tensor: reading that back would be
    a host conversion on every step, and under ``plan --trace`` it is a fake tensor. Ranks,
    not group objects: a second model built in one process (a benchmark's) may place its
    DTensors on the first one's groups over the same ranks.

    A rank sees only the row and the column of the mesh through itself. They fix the whole
    mesh, and so the same answer on every rank, for an evenly strided mesh: every mesh
    boostlr builds (``init_device_mesh`` and its unflattening). A hand-permuted mesh could
    agree on some ranks' rows and columns only, and those ranks would then wait in different
    collectives."""
    first = tensors[0]
    if flat is None or not isinstance(first, DTensor):
        return False
    groups = first.device_mesh.get_all_groups()
    if len(groups) != len(flat.dims) or any(
        dist.get_process_group_ranks(g) != dist.get_process_group_ranks(d)
        for g, d in zip(groups, flat.dims, strict=True)
    ):
        return False  # another mesh: its ranks need not be the flat group's
    # Neither replicated nor partial: a shard (FSDP's over dp_rep is a strided one).
    return all(not (p.is_replicate() or p.is_partial()) for t in tensors for p in t.placements)
