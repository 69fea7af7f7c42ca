"""Bottleneck-aware tensor parallelism (BTP), docs/design.md §2.

A TP region starts at an up-projection B (column-parallel: splits its *output* — heads, MLP
width, or the residual's d) and ends at the next down-projection A (row-parallel: splits its
*input*). The only collective between regions is the all-reduce of A's ``[T, r]`` output, so
the residual stream stays sharded along d and the latents ``σ(A x)`` are replicated.

Companions implemented here:

* online-RMSNorm: a norm in front of an A is folded into it. Each rank pre-normalises its
  slice by its local rms (keeps bf16 in range), multiplies the rms back after the GEMM and
  sends ``[p | Σx²]`` in the *same* all-reduce (Σx² in fp32 precision: as a hi/lo pair of
  bf16 columns under bf16); ``y = p / sqrt(Σx²/d + eps)`` afterwards.
  ``norm="sync"`` sends the statistics in a separate all-reduce (ablation).
* linear-layer grouping: ``[A_q|A_k|A_v]`` and ``[A_gate|A_up]`` are one GEMM and one
  all-reduce; same-shaped up-projections run as one batched GEMM.
* low-rank activation checkpointing: each region (no collective inside) is checkpointed on
  its own, saving only its replicated latent and residual slice; the re-forward issues no
  communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from boostlr.models.llama import Block, Latents, LlamaModel, causal_attention
from boostlr.models.lowrank import LowRankLinear
from boostlr.models.mlp import GATED, gated
from boostlr.models.moe import MOE
from boostlr.models.norm import rms_norm
from boostlr.models.params import in_dtype, local
from boostlr.parallel import btp_moe
from boostlr.parallel.collectives import (
    PendingAllReduce,
    copy_to_group,
    copy_to_group_pending,
    gather_from_group,
    reduce_from_group,
    reduce_scatter_to_group,
)
from boostlr.parallel.context import TPContext, wire
from boostlr.parallel.vocab import vocab_parallel_embedding
from boostlr.specs.strategy import BTP

SPEC = BTP
#: The MLP kinds :func:`block_forward` runs.
MLP_KINDS = (GATED, MOE)


def embed(model: LlamaModel, tokens: Tensor, ctx: TPContext) -> Tensor:
    """Whole rows (of this rank's d-slice), split over dp only.

    A table tied to the LM head is split as the head is, along the vocabulary: each rank
    looks up its rows (zeros for the rest) at full width and one reduce-scatter over tp sums
    the partial embeddings into each rank's d-slice (backward: an all-gather of the slices'
    gradients). Autograd adds the lookup's and the head's gradient in the one parameter."""
    weight = local(model.embed_tokens.weight)
    if model.cfg.tie_embeddings:
        rows = vocab_parallel_embedding(tokens, weight, ctx.vocab_split())
        return reduce_scatter_to_group(rows, ctx.comm, "embed", dim=-1)
    split = ctx.vocab_split(rows_over_tp=False)
    return vocab_parallel_embedding(tokens, weight, split, ctx.vocab_dp)


def head_input(model: LlamaModel, x: Tensor, ctx: TPContext) -> Tensor:
    """All-gather the last hidden state once and normalise it; every rank multiplies it by
    its vocabulary slice.

    The head's input gradient is a partial sum per rank, so the gathers reduce-scatter it
    (and the final norm's gain gradient) back to d-slices in the backward.
    """
    x_full = gather_from_group(x, ctx.comm, "final_hidden", dim=-1, grad="reduce_scatter")
    gain = gather_from_group(
        local(model.norm.weight), ctx.comm, "final_norm_gain", dim=0, grad="reduce_scatter"
    )
    return rms_norm(x_full, gain, model.norm.eps)


# ------------------------------------------------------------------------ norm + down-proj


class _GroupedDown(torch.autograd.Function):
    """``[y A_1ᵀ | y A_2ᵀ | ...]`` as one GEMM over the stacked rows ``[A_1; A_2; ...]``.

    Autograd would save the concatenated weight for the backward: a copy of the block's
    down-projections per micro-batch in flight, which also outlives FSDP's reshard. Here
    only ``y`` and the weights themselves are saved; the backward concatenates again (a
    transient) and computes every weight gradient in one GEMM, split by rows.
    """

    @staticmethod
    def forward(ctx, y: Tensor, *downs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        device = y.device.type
        ctx.device, ctx.autocast = device, torch.is_autocast_enabled(device)
        ctx.autocast_dtype = torch.get_autocast_dtype(device)
        ctx.save_for_backward(y, *downs)
        ctx.sizes = [a.shape[0] for a in downs]
        return tuple(F.linear(y, torch.cat(downs)).split(ctx.sizes, -1))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        y, *downs = ctx.saved_tensors
        with torch.autocast(ctx.device, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            grad = torch.cat(grads, -1)
            grad_y = in_dtype(torch.matmul(grad, torch.cat(downs)), y.dtype)
            grad_w = torch.matmul(grad.flatten(0, -2).t(), y.flatten(0, -2))
        return (
            grad_y,
            *(in_dtype(g, a.dtype) for g, a in zip(grad_w.split(ctx.sizes), downs, strict=True)),
        )


def _down(y: Tensor, downs: list[Tensor], grouped: bool) -> list[Tensor]:
    """A projections of one input; grouped: one GEMM over the stacked rows ``[A_1; A_2; ...]``."""
    if grouped and len(downs) > 1:
        return list(_GroupedDown.apply(y, *downs))
    return [F.linear(y, a) for a in downs]


def _norm_down_partial(
    x: Tensor, gain: Tensor, eps: float, downs: list[Tensor], grouped: bool, whole: bool
) -> tuple[Tensor, ...]:
    """This rank's share of ``A · RMSNorm(x)`` for each A, plus its ``Σ x²`` (fp32).

    Pre-normalising by the local rms and multiplying it back keeps the GEMM input in range
    in bf16 while the sum over ranks is still exactly ``A (g ⊙ x)``. A rank that holds all of
    d (``whole``: TP 1) has nothing to share: the plain RMSNorm, then the GEMM.
    """
    if whole:
        return tuple(_down(rms_norm(x, gain, eps), downs, grouped))
    x32 = in_dtype(x, torch.float32)
    ss = x32.pow(2).sum(-1, keepdim=True)
    # A constant scale (its gradient terms cancel exactly), so it is detached.
    local_rms = torch.sqrt(ss / x.shape[-1] + 1e-12).detach()
    y = gain * in_dtype(x32 / local_rms, x.dtype)
    return (ss, *(in_dtype(p, torch.float32) * local_rms for p in _down(y, downs, grouped)))


def stats_hi_bits(tp: int) -> int:
    """Significant bits of the high part of :func:`split_stats`: ``tp`` such parts whose
    sizes differ by up to 4x add up exactly in bf16's 8 bits."""
    return max(1, 8 - 2 - math.ceil(math.log2(tp)))


def split_stats(ss: Tensor, dtype: torch.dtype, tp: int) -> Tensor:
    """``Σx²`` ``[T, 1]`` (fp32) as the columns that ride in the partials' all-reduce.

    In fp32: itself. In bf16 (8 significant bits): a hi/lo pair. ``hi`` keeps only
    :func:`stats_hi_bits` bits, so the all-reduce adds the ``tp`` ranks' ``hi`` exactly, and
    ``lo = Σx² - hi`` carries the next 8 bits: the sum is good to about
    ``2^-(hi_bits + 9)`` relative instead of bf16's ``2^-9`` per rounding, while the
    statistics keep riding in the one all-reduce of the partials (one dtype, the same
    ``[T, 2]`` columns on every rank). Gradients reach ``Σx²`` through ``lo`` (``hi`` is a
    rounding of it, held constant).
    """
    if dtype == torch.float32:
        return ss
    bits = stats_hi_bits(tp)
    mantissa, exponent = torch.frexp(ss.detach())
    hi = torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent)
    return in_dtype(torch.cat([hi, ss - hi], -1), dtype)


def join_stats(columns: Tensor) -> Tensor:
    """The all-reduced :func:`split_stats` columns back to one fp32 ``Σx²`` ``[T, 1]``."""
    return in_dtype(columns, torch.float32).sum(-1, keepdim=True)


def _reduce_norm_down(
    parts: tuple[Tensor, ...], dim: int, eps: float, ctx: TPContext, tag: str
) -> list[Tensor]:
    """All-reduce the partials (stats riding along unless ``norm=sync``), then normalise.

    The partials travel in the compute dtype (bf16 under autocast); the statistics in fp32
    precision (:func:`split_stats`: a hi/lo pair of bf16 columns in the same all-reduce; with
    ``norm=sync``, their own fp32 all-reduce); the normalisation itself is done in fp32. At
    TP 1 the parts already are the normalised projections.
    """
    if ctx.comm.size == 1:
        return list(parts)
    partials = [wire(p) for p in parts[1:]]
    sizes = [p.shape[-1] for p in partials]
    comm = ctx.comm
    if ctx.norm == "sync":
        ss = reduce_from_group(in_dtype(parts[0], torch.float32), comm, f"{tag}.norm_stats")
        if ctx.grouping:
            partials = list(reduce_from_group(torch.cat(partials, -1), comm, tag).split(sizes, -1))
        else:
            partials = [reduce_from_group(p, comm, f"{tag}.{i}") for i, p in enumerate(partials)]
        return list(_Normalise.apply(dim, eps, ss, *partials))
    stats = split_stats(in_dtype(parts[0], torch.float32), partials[0].dtype, comm.size)
    if ctx.grouping:
        packed = reduce_from_group(torch.cat([*partials, stats], -1), comm, tag)
        *partials, stats = packed.split([*sizes, stats.shape[-1]], -1)
    else:  # the statistics ride with the first down-projection's all-reduce
        first = reduce_from_group(torch.cat([partials[0], stats], -1), comm, f"{tag}.0")
        partials[0], stats = first.split([sizes[0], stats.shape[-1]], -1)
        partials[1:] = [
            reduce_from_group(p, comm, f"{tag}.{i}") for i, p in enumerate(partials[1:], 1)
        ]
    return list(_Normalise.apply(dim, eps, join_stats(stats), *partials))


class _Normalise(torch.autograd.Function):
    """``y_i = p_i / sqrt(Σx² / d + eps)`` for the all-reduced partials ``p_i`` (fp32).

    Autograd's own ``p * rsqrt(...)`` saves ``p``: the whole all-reduced ``[T, r·k + 1]``
    buffer, next to the ``y`` the latents' σ saves anyway. Here only the outputs ``y_i`` and
    the ``[T, 1]`` inverse rms are saved (``p = y / inv``): the gradients are
    ``∂p_i = g_i · inv`` and ``∂Σx² = -inv² · Σ_i Σ(g_i · y_i) / (2d)``.
    """

    @staticmethod
    def forward(ctx, dim: int, eps: float, ss: Tensor, *partials: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        inv = torch.rsqrt(in_dtype(ss, torch.float32) / dim + eps)
        ys = tuple(in_dtype(p, torch.float32) * inv for p in partials)
        ctx.dim, ctx.dtypes, ctx.ss_dtype = dim, [p.dtype for p in partials], ss.dtype
        ctx.save_for_backward(inv, *ys)
        return ys

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        inv, *ys = ctx.saved_tensors
        dot = sum((g * y).sum(-1, keepdim=True) for g, y in zip(grads, ys, strict=True))
        grad_ss = (-0.5 / ctx.dim) * inv * inv * dot
        grad_p = [in_dtype(g * inv, dt) for g, dt in zip(grads, ctx.dtypes, strict=True)]
        return (None, None, in_dtype(grad_ss, ctx.ss_dtype), *grad_p)


# ------------------------------------------------------------------------ latents + up-proj


def _latents(
    linears: list[LowRankLinear], pre: list[Tensor], names: list[str], z_prev: Latents | None
) -> tuple[list[Tensor], Latents]:
    """σ / LaX crossing on the replicated latents (local: every rank holds all of r)."""
    hs, z = [], {}
    for lin, a, name in zip(linears, pre, names, strict=True):
        h, latent = lin.latent(a, None if z_prev is None else z_prev.get(name))
        # A LaX latent leaves the block, and FSDP hooks a block's outputs: a view output
        # would lose that hook to any in-place op on it (FSDP warns). Without a gate (block
        # 0) the latent is a slice of the grouped down-projection, so it is copied out.
        z[name] = latent if latent is None or latent._base is None else latent.clone()
        hs.append(h)
    return hs, z


def _enter_region(
    hs: list[Tensor], ctx: TPContext, tag: str
) -> tuple[list[Tensor], PendingAllReduce | None]:
    """Identity forward; the backward all-reduces B's partial input grads (one per group).

    With ``ctx.overlap`` (grouped, eager) the region's B starts that all-reduce itself, before
    its weight-gradient GEMM (:class:`_UpProjection`); the returned pending all-reduce links
    the two.
    """
    hs = [wire(h) for h in hs]
    if len(hs) > 1 and not ctx.grouping:
        return [copy_to_group(h, ctx.comm, f"{tag}.latent.{i}") for i, h in enumerate(hs)], None
    joined = hs[0] if len(hs) == 1 else torch.cat(hs, -1)
    name = f"{tag}.latent" if len(hs) > 1 else f"{tag}.latent.0"
    pending = PendingAllReduce(ctx.comm, name) if ctx.overlap and ctx.comm.size > 1 else None
    if pending is None:
        joined = copy_to_group(joined, ctx.comm, name)
    else:
        joined = copy_to_group_pending(joined, pending)
    parts = [joined] if len(hs) == 1 else list(joined.split([h.shape[-1] for h in hs], -1))
    return parts, pending


class _UpProjection(torch.autograd.Function):
    """``y_i = h_i B_iᵀ`` whose backward starts the latents' all-reduce before ``∂B``.

    The input gradients ``∂h_i = ∂y_i B_i`` are computed first and sent off (concatenated, the
    layout :func:`_enter_region` joined them in); the weight gradients ``∂B_i = ∂y_iᵀ h_i``
    are computed while the ranks exchange them. Autocast is replayed in the backward so the
    GEMMs run in the forward's dtype, as autograd's own would. Only the ``h_i`` and ``B_i``
    themselves are saved: the grouped forward's stacked copies (one batched GEMM) are
    transients, never held for the backward. Without a ``pending`` all-reduce (TP 1) it is
    the same Function minus the early start.
    """

    @staticmethod
    def forward(
        ctx, pending: PendingAllReduce | None, grouped: bool, *hw: Tensor
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        n = len(hw) // 2
        hs, ws = list(hw[:n]), list(hw[n:])
        device = hs[0].device.type
        ctx.pending, ctx.device = pending, device
        ctx.autocast = torch.is_autocast_enabled(device)
        ctx.autocast_dtype = torch.get_autocast_dtype(device)
        ctx.save_for_backward(*hs, *ws)
        return tuple(_up_math(hs, ws, grouped))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        n = len(saved) // 2
        hs, ws = saved[:n], saved[n:]
        with torch.autocast(ctx.device, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            grad_h = [
                in_dtype(torch.matmul(g, w), h.dtype) for g, w, h in zip(grads, ws, hs, strict=True)
            ]
            if ctx.pending is not None:
                ctx.pending.start(grad_h[0] if n == 1 else torch.cat(grad_h, -1))
            grad_w = [
                in_dtype(torch.matmul(g.flatten(0, -2).t(), h.flatten(0, -2)), w.dtype)
                for g, w, h in zip(grads, ws, hs, strict=True)
            ]
        return (None, None, *grad_h, *grad_w)


def _up(
    hs: list[Tensor], weights: list[Tensor], grouped: bool, pending: PendingAllReduce | None = None
) -> list[Tensor]:
    """B projections; same-shaped ones as one batched GEMM when grouping is on.

    With a ``pending`` all-reduce (see :func:`_enter_region`) the backward starts it before
    the weight gradients.
    """
    if pending is not None or (grouped and len(hs) > 1):
        return list(_UpProjection.apply(pending, grouped, *hs, *weights))
    return _up_math(hs, weights, grouped)


def _up_math(hs: list[Tensor], weights: list[Tensor], grouped: bool) -> list[Tensor]:
    out: list[Tensor | None] = [None] * len(hs)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, w in enumerate(weights):
        by_shape.setdefault(tuple(w.shape) if grouped else (i,), []).append(i)
    for idx in by_shape.values():
        if len(idx) == 1:
            out[idx[0]] = F.linear(hs[idx[0]], weights[idx[0]])
            continue
        lead = hs[idx[0]].shape[:-1]
        h = torch.stack([hs[i].reshape(-1, hs[i].shape[-1]) for i in idx])
        w = torch.stack([weights[i] for i in idx])
        # unbind, not y[j]: each indexing's backward would zero-fill a gradient of all of y.
        for i, y in zip(idx, torch.bmm(h, w.transpose(1, 2)).unbind(0), strict=True):
            out[i] = y.reshape(*lead, -1)
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------ the block

QKV = ["q_proj", "k_proj", "v_proj"]
#: The region (and all-reduce) name of the MLP's readers' grouped down-projection.
MLP_READS = "gate_up"


def block_forward(
    block: Block, x: Tensor, rope: tuple[Tensor, Tensor], z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents]:
    """One block on the d-sharded residual ``x``; four ``[T, r·k]`` all-reduces forward.

    An MoE block (:mod:`boostlr.parallel.btp_moe`) shares the attention and the folded MLP
    norm; its router's partial logits ride in the readers' all-reduce.
    """
    if block.mlp.kind == MOE:
        moe = block.mlp
        z: Latents = {}
        h_o, pending_o = _attention(block, x, rope, z_prev, ctx, z)
        x, pre = _mlp_reads(block, h_o, pending_o, x, lambda: btp_moe.read_downs(moe, ctx), ctx)
        x, z_moe = btp_moe.mlp_forward(moe, pre, x, z_prev, ctx)
        z.update(z_moe)
        return x, z
    mlp = gated(block.mlp, SPEC.name)
    reads = mlp.readers()
    read_names, readers = [name for name, _ in reads], [lin for _, lin in reads]
    write_name, writer = mlp.writer()
    grouped = ctx.grouping
    z = {}
    h_o, pending_o = _attention(block, x, rope, z_prev, ctx, z)
    x, pre = _mlp_reads(
        block, h_o, pending_o, x, lambda: [local(lin.down.weight) for lin in readers], ctx
    )
    hs, z_reads = _latents(readers, pre, read_names, z_prev)
    z.update(z_reads)
    hs, pending_reads = _enter_region(hs, ctx, MLP_READS)

    # Region: the readers' B's (this rank's slice of f) -> combine -> partial A of the writer.
    def mlp_region(*h: Tensor) -> Tensor:
        outs = _up(list(h), [local(l.up.weight) for l in readers], grouped, pending_reads)
        return F.linear(mlp.combine(*outs), local(writer.down.weight))

    p_d = reduce_from_group(ctx.region(write_name, mlp_region, *hs), ctx.comm, write_name)
    (h_d,), z_d = _latents([writer], [p_d], [write_name], z_prev)
    z.update(z_d)
    (h_d,), pending_d = _enter_region([h_d], ctx, write_name)

    # Region: the writer's B writes the residual slice (continues into the next block's A_qkv).
    def residual_mlp_region(h: Tensor, x_: Tensor) -> Tensor:
        (b_down,) = _up([h], [local(writer.up.weight)], grouped, pending_d)
        return x_ + b_down

    return ctx.region("residual", residual_mlp_region, h_d, x), z


def _attention(
    block: Block,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    z_prev: Latents | None,
    ctx: TPContext,
    z: Latents,
) -> tuple[Tensor, PendingAllReduce | None]:
    """The attention up to ``A_o``'s replicated latent (entered into ``B_o``'s region);
    adds the q/k/v/o latents to ``z``."""
    attn, cfg = block.self_attn, ctx.cfg
    qkv = [getattr(attn, n) for n in QKV]
    grouped = ctx.grouping

    # Region ending at A_qkv: norm folded into the grouped down-projection.
    whole = ctx.comm.size == 1
    # Distinct names: a checkpointed region's closure is re-run in the backward.
    attn_norm = block.input_layernorm
    parts = ctx.region(
        "qkv",
        lambda x_: _norm_down_partial(
            x_,
            local(attn_norm.weight),
            attn_norm.eps,
            [local(l.down.weight) for l in qkv],
            grouped,
            whole,
        ),
        x,
    )
    pre = _reduce_norm_down(parts, cfg.dim, attn_norm.eps, ctx, "qkv")
    hs, z_qkv = _latents(qkv, pre, QKV, z_prev)
    z.update(z_qkv)
    hs, pending_qkv = _enter_region(hs, ctx, "qkv")

    # Region: B_q/B_k/B_v (this rank's heads) -> attention -> partial A_o.
    def attention_region(*h: Tensor) -> Tensor:
        q, k, v = _up(list(h), [local(l.up.weight) for l in qkv], grouped, pending_qkv)
        out = causal_attention(q, k, v, rope, attn.head_dim)
        return F.linear(out, local(attn.o_proj.down.weight))

    p_o = reduce_from_group(ctx.region("o_proj", attention_region, *hs), ctx.comm, "o_proj")
    (h_o,), z_o = _latents([attn.o_proj], [p_o], ["o_proj"], z_prev)
    z.update(z_o)
    (h_o,), pending_o = _enter_region([h_o], ctx, "o_proj")
    return h_o, pending_o


def _mlp_reads(
    block: Block,
    h_o: Tensor,
    pending_o: PendingAllReduce | None,
    x: Tensor,
    downs: Callable[[], list[Tensor]],
    ctx: TPContext,
) -> tuple[Tensor, list[Tensor]]:
    """``B_o`` writes the residual slice, then the MLP norm folded into the ``downs`` (the
    readers' A's, an MoE router's slice too): one all-reduce. Returns ``(x, normed)``."""
    attn, mlp_norm = block.self_attn, block.post_attention_layernorm
    whole = ctx.comm.size == 1

    def residual_attn_region(h: Tensor, x_: Tensor) -> tuple[Tensor, ...]:
        (b_o,) = _up([h], [local(attn.o_proj.up.weight)], ctx.grouping, pending_o)
        x_ = x_ + b_o
        gain = local(mlp_norm.weight)
        return (x_, *_norm_down_partial(x_, gain, mlp_norm.eps, downs(), ctx.grouping, whole))

    x, *parts = ctx.region(MLP_READS, residual_attn_region, h_o, x)
    return x, _reduce_norm_down(tuple(parts), ctx.cfg.dim, mlp_norm.eps, ctx, MLP_READS)
