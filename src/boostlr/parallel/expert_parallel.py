"""Expert parallelism: the routed experts spread over the ``ep`` group (docs/moe.md).

:func:`shard_experts` keeps each ep rank's ``E / ep`` experts as ``Shard(0)`` DTensors and
gives every MoE layer :func:`dropless_ep` as its dispatch: each routed copy travels to its
expert's owner by an all-to-all over ``ep`` and its result comes back by the reverse one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from boostlr.models.moe import moe_layers
from boostlr.models.moe_dispatch import ExpertFn, expert_counts, host_counts
from boostlr.parallel.collectives import GroupComm, all_to_all_single, exchange_counts
from boostlr.parallel.mesh import MeshComms


def dropless_ep(
    payload: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: int,
    fn: ExpertFn,
    comm: GroupComm,
    tag: str = "moe",
) -> torch.Tensor:
    """``dropless`` (:mod:`boostlr.models.moe_dispatch`) with expert ``e`` on ep rank
    ``e // (E / ep)`` (``fn`` takes the local index ``e % (E / ep)``): the same sum, computed
    where the experts live.

    The copies, sorted by expert, are already grouped by owner. The ``[ep, E / ep]`` counts
    go first (a fixed shape), then the payload; what arrives is grouped by source rank, then
    expert, and is regrouped by expert for ``fn``. The results go back by the reverse
    all-to-all, and weighting and summing happen at the token's own rank, as in
    ``dropless``. Every local expert runs, on an empty slice if it got nothing.
    """
    ep, k = comm.size, idx.shape[1]
    per = experts // ep
    order = torch.argsort(idx.reshape(-1), stable=True)
    token = order // k
    counts = expert_counts(idx, experts).view(ep, per)
    incoming = exchange_counts(counts, comm, tag)  # [source, local expert]
    both = host_counts(torch.cat([counts.reshape(-1), incoming.reshape(-1)]))
    sent, got = both[: ep * per], both[ep * per :]
    send = [sum(sent[j * per : (j + 1) * per]) for j in range(ep)]
    recv = [sum(got[j * per : (j + 1) * per]) for j in range(ep)]
    arrived = all_to_all_single(payload[token], send, recv, comm, tag).split(got)
    # arrived[j * per + e]: source j's copies for local expert e.
    ran = each_expert(fn, [torch.cat(arrived[e::per]) for e in range(per)])
    parts = [r.split([got[j * per + e] for j in range(ep)]) for e, r in enumerate(ran)]
    back = torch.cat([parts[e][j] for j in range(ep) for e in range(per)])
    out = all_to_all_single(back, recv, send, comm, tag)
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    combined = out.new_zeros(payload.shape[0], out.shape[-1])
    return combined.index_add(0, token, out)


def each_expert(fn: ExpertFn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``fn(inputs[e], e)`` for every local expert ``e``.

    Experts sharded over ``dp_rep`` are one FSDP unit
    (:func:`boostlr.parallel.data_parallel.shard_experts_over_dp`), which gathers its weights
    and reduce-scatters their gradient once per forward call: the whole loop is that one
    call (its ``each_expert`` method), not one call per expert.
    """
    run = getattr(fn, "each_expert", None)
    if run is not None:
        return run(inputs)
    return [fn(x, e) for e, x in enumerate(inputs)]


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` (a global name) is a routed expert's stacked weight, the
    tensors expert parallelism shards (the shared experts' are not)."""
    return ".mlp.experts." in name


def expert_rows(experts: int, ep: GroupComm) -> tuple[int, int]:
    """The rows ``[start, end)`` of the expert dimension this ep rank holds."""
    per = experts // ep.size
    return ep.rank * per, (ep.rank + 1) * per


def as_expert_dtensor(shard: torch.Tensor, comms: MeshComms, shape: torch.Size) -> DTensor:
    """This ep rank's rows of a stacked ``[E, ...]`` weight, as ``Shard(0)`` on ``ep``."""
    stride = torch.empty(shape, device="meta").stride()
    mesh = comms.dim_mesh("ep")
    return DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def use_expert_parallel(model: nn.Module, ep: GroupComm) -> None:
    """Give every MoE layer in ``model`` the all-to-all dispatch over ``ep``."""
    for layer in moe_layers(model):
        layer.dispatch = functools.partial(dropless_ep, comm=ep)


def shard_experts(model: nn.Module, comms: MeshComms) -> None:
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
    use_expert_parallel(model, ep)


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


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of gradients that live on several meshes (FSDP's ``dp``, the experts'
    ``ep``), as a plain 0-d tensor.

    ``get_total_norm`` stacks its per-tensor norms, which DTensor refuses across meshes; so
    each mesh's gradients are normed together (a DTensor norm resolved over its mesh: an
    ep shard's experts counted once), then those norms are. On one mesh it is that mesh's
    norm, the same value as before there were two.
    """
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm([grads[i] for i in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, 2.0)
