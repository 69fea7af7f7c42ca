"""An MoE block's MLP under BTP (latent dispatch; design notes §9, docs/moe.md).

:func:`boostlr.parallel.btp.block_forward` runs the attention and folds the MLP norm into
the grouped down-projection as for a dense block; for an MoE block the down-projections are
``[A_g | A_u | W_r]``: the router is row-parallel on the d-sharded residual like ``A_g, A_u``,
so its partial logits ride in the same all-reduce as ``[p_g | p_u | Σx²]`` and routing adds
no collective. Every TP rank then holds the same logits, top-k and latents ``z``; each rank
dispatches only its ``1/tp`` share of the tokens, and the combined r-wide results are
all-gathered over TP before ``B_d``'s local slice writes the rank's residual slice.

With expert parallelism (``ep`` carved out of dp) the share goes to the ep peers of the
same TP rank (the ep group is cut at a fixed TP coordinate), so no token crosses the ep group
twice; each ep rank holds ``E / ep`` experts on every TP rank.

Gradients: the latents and logits of the shares meet in one all-reduce backward (as the
dense readers' latents do); the gather's backward reduce-scatters ``B_d``'s partial input
gradients. The experts (routed and shared, whole over TP) and the router (whole, used by its
d-slice) see different tokens (or columns) on each rank, so each TP rank's gradient is a
partial sum. The sum is linear, so it waits for the step's end: :func:`sum_moe_grads_over_tp`
adds them over TP once per step, on the accumulated fp32 gradients (after FSDP's
reduction), in one all-reduce, like sequence-parallel norm weights: not once per
micro-batch on the compute dtype's gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from boostlr.models.moe import Latents, MoEMLP, moe_layers
from boostlr.models.params import forward_dtype, local
from boostlr.models.placement import chunk_range
from boostlr.parallel.collectives import (
    GroupComm,
    PendingAllReduce,
    copy_to_group,
    gather_from_group,
)
from boostlr.parallel.context import TPContext

#: Ledger tags of the MoE block's own collectives.
LATENT_TAG = "moe.latent"  # backward: the shares' latent and logit gradients summed
COMBINED_TAG = "moe.combined"  # forward all-gather of [T/tp, r]; backward reduce-scatter
GRAD_TAG = "moe.weight_grads"  # once per step: expert and router weight gradients summed


def read_downs(moe: MoEMLP, ctx: TPContext) -> list[Tensor]:
    """The MLP norm's down-projections: ``A_g``, ``A_u`` (d-slices) and the router's columns
    of this rank's d-slice, whose gradient is summed over TP once per step (each rank fills
    its columns: :func:`sum_moe_grads_over_tp`)."""
    router = local(moe.router.weight)
    start, end = chunk_range(router.shape[-1], ctx.comm.rank, ctx.comm.size)
    return [local(moe.gate_proj.down.weight), local(moe.up_proj.down.weight), router[:, start:end]]


def mlp_forward(
    moe: MoEMLP, pre: list[Tensor], x: Tensor, z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents]:
    """The MoE MLP from the all-reduced, normalised ``[A_g x | A_u x | W_r x]`` (replicated)
    to the residual slice ``x + B_d ...``; returns ``(x, latents)``."""
    comm = ctx.comm
    pre_g, pre_u, logits = pre
    zg, lat_g = moe.gate_proj.latent(pre_g, _get(z_prev, "gate_proj"))
    zu, lat_u = moe.up_proj.latent(pre_u, _get(z_prev, "up_proj"))
    z: Latents = {"gate_proj": _own(lat_g), "up_proj": _own(lat_u), "down_proj": None}
    lead = x.shape[:-1]
    tokens = lead.numel()
    if tokens % comm.size:
        raise ValueError(
            f"an MoE block under BTP splits a micro-batch's {tokens} tokens over tp "
            f"{comm.size}: make batch x sequence length a multiple of tp"
        )
    logits = logits.reshape(tokens, -1)
    payload = torch.cat([zg, zu], dim=-1).reshape(tokens, -1)
    # Every token's routing, equal on all ranks: the load, statistics and balance loss of
    # the whole micro-batch (the balance loss's gradient is each rank's own, not summed).
    route_all = moe.router.select(logits)
    # One backward all-reduce for both; in the logits' dtype (fp32 at least), so the share's
    # top-k is taken on the very values ``route_all`` was.
    width, dtype = payload.shape[-1], torch.promote_types(payload.dtype, logits.dtype)
    joined = copy_to_group(torch.cat([payload.to(dtype), logits.to(dtype)], -1), comm, LATENT_TAG)
    share = tokens // comm.size
    mine = joined[comm.rank * share : (comm.rank + 1) * share]
    route = moe.router.select(mine[:, width:])
    # In the compute dtype, as the one device's latents (its A_g, A_u are autocast GEMMs):
    # what the experts' GEMMs read anyway, and half the bytes the ep all-to-all sends under
    # bf16 (the normalised latents here are fp32).
    pay = mine[:, :width].to(forward_dtype(payload))
    out = moe.routed(pay, route)
    if hasattr(moe, "shared"):
        out = out + moe.shared(pay, None).sum(0)
    full = gather_from_group(out, comm, COMBINED_TAG, dim=0, grad="reduce_scatter")
    y = F.linear(full, local(moe.down_proj.up.weight)).reshape(*lead, -1)
    return x + moe.account(y, route_all, lead), z


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """The MoE parameters whose gradient each TP rank holds a part of: every MoE layer's
    router, routed and shared experts (whole over TP, used on the rank's share or d-slice)."""
    return [
        p
        for layer in moe_layers(model)
        for part in (layer.router, layer.experts, getattr(layer, "shared", None))
        if part is not None
        for p in part.parameters()
        if p.requires_grad
    ]


@torch.no_grad()
def sum_moe_grads_over_tp(model: nn.Module, comm: GroupComm) -> None:
    """Sum over TP the MoE gradients each TP rank holds a part of (:func:`tp_partial_params`):
    one fp32 all-reduce of their local gradients, flattened and concatenated.

    Call once per step, after the last backward (and FSDP's reduction, which is linear, so
    the order does not matter) and before clipping. The TP ranks of one (pp, dp) coordinate
    hold the same layers, the same shards of them (FSDP's dp shard, the ep rank's experts)
    and the same gradients present (each weight stack is one parameter that every training
    forward uses), so the buffer has one shape on all of them by construction.
    """
    if comm.size == 1:
        return
    grads = [p.grad for p in tp_partial_params(model) if p.grad is not None]
    if not grads:
        return
    parts = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1).float() for g in parts])
    summed = PendingAllReduce(comm, GRAD_TAG).finish(flat)
    for g, s in zip(parts, summed.split([g.numel() for g in parts]), strict=True):
        g.copy_(s.view_as(g))


def _own(latent: Tensor | None) -> Tensor | None:
    """A LaX latent that is a view, copied out (a block output: FSDP hooks it)."""
    return latent if latent is None or latent._base is None else latent.clone()


def _get(z: Latents | None, name: str) -> Tensor | None:
    return None if z is None else z.get(name)
