"""An MoE block's MLP under BTP (latent dispatch; design notes §9, docs/moe.md).

:func:`boostlr.parallel.btp.block_forward` runs the attention and folds the MLP norm into
the grouped down-projection as for a dense block; for an MoE block the down-projections are
``[A_g | A_u | W_r]``: the router is row-parallel on the d-sharded residual like ``A_g, A_u``,
so its partial logits ride in the same all-reduce as ``[p_g | p_u | Σx²]`` and routing adds
no collective. Every TP rank then holds the same logits, top-k and latents ``z``; each rank
dispatches only its ``1/tp`` share of the tokens, and the combined r-wide results are
all-gathered over TP before ``B_d``'s local slice writes the rank's residual slice.

Gradients: the latents and logits of the shares meet in one all-reduce backward (as the
dense readers' latents do); the gather's backward reduce-scatters ``B_d``'s partial input
gradients. The experts (whole on every TP rank) and the router (whole, used by its d-slice)
see different tokens (or columns) on each rank, so their gradients are summed over TP by
identity-forward, all-reduce-backward copies of their weights: one all-reduce for the router,
one per expert group (routed, shared).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from boostlr.models.moe import Latents, MoEMLP
from boostlr.models.moe_dispatch import ExpertFn
from boostlr.models.params import local
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
GRAD_TAG = "moe.weight_grads"  # backward: expert and router weight gradients summed


def read_downs(moe: MoEMLP, ctx: TPContext) -> list[Tensor]:
    """The MLP norm's down-projections: ``A_g``, ``A_u`` (d-slices) and the router's columns
    of this rank's d-slice, whose gradient is summed over TP (each rank fills its columns)."""
    router = copy_to_group(local(moe.router.weight), ctx.comm, f"{GRAD_TAG}.router")
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
    pay = mine[:, :width].to(payload.dtype)
    out = moe.routed(pay, route, _summed_over_tp(moe.experts, ctx, "experts"))
    if hasattr(moe, "shared"):
        out = out + _summed_over_tp(moe.shared, ctx, "shared")(pay, None).sum(0)
    full = gather_from_group(out, comm, COMBINED_TAG, dim=0, grad="reduce_scatter")
    y = F.linear(full, local(moe.down_proj.up.weight)).reshape(*lead, -1)
    return x + moe.account(y, route_all, lead), z


class _SumGradsOverTP(torch.autograd.Function):
    """Identity on several weights; the backward sums all their gradients over TP in one
    all-reduce (flattened and concatenated: the same shape on every rank)."""

    @staticmethod
    def forward(ctx, comm: GroupComm, tag: str, *weights: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.comm, ctx.tag = comm, tag
        ctx.shapes = [w.shape for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        sample = next(g for g in grads if g is not None)
        flat = torch.cat(
            [
                (sample.new_zeros(shape) if g is None else g).reshape(-1)
                for g, shape in zip(grads, ctx.shapes, strict=True)
            ]
        )
        summed = PendingAllReduce(ctx.comm, ctx.tag).finish(flat)
        sizes = [shape.numel() for shape in ctx.shapes]
        parts = summed.split(sizes)
        return (None, None, *(p.view(s) for p, s in zip(parts, ctx.shapes, strict=True)))


def _summed_over_tp(experts: nn.Module, ctx: TPContext, name: str) -> ExpertFn:
    """``experts`` whose weight gradients are summed over TP (each rank ran other tokens):
    one backward all-reduce for all of them."""
    if ctx.comm.size == 1:
        return experts
    keys, params = zip(*experts.named_parameters(), strict=True)
    summed = _sum_grads_over_tp(ctx.comm, f"{GRAD_TAG}.{name}", *(local(p) for p in params))
    weights = dict(zip(keys, summed, strict=True))
    return lambda x, e: functional_call(experts, weights, (x, e))


@torch.compiler.disable
def _sum_grads_over_tp(comm: GroupComm, tag: str, *weights: Tensor) -> tuple[Tensor, ...]:
    """:class:`_SumGradsOverTP` outside any compiled graph (a collective is a boundary)."""
    return _SumGradsOverTP.apply(comm, tag, *weights)


def _own(latent: Tensor | None) -> Tensor | None:
    """A LaX latent that is a view, copied out (a block output: FSDP hooks it)."""
    return latent if latent is None or latent._base is None else latent.clone()


def _get(z: Latents | None, name: str) -> Tensor | None:
    return None if z is None else z.get(name)
