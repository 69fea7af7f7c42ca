"""Vocab-parallel embedding, LM head input and cross-entropy (Megatron style, over dp too).

A rank owns a contiguous range of vocabulary rows (:class:`VocabSplit`). Split over TP, each
rank holds ``torch.chunk``'s share (the last ranks may hold fewer rows when TP does not
divide the vocabulary, or none at all, e.g. V=5 at TP=4 splits 2, 2, 1, 0; an empty slice
contributes zeros, never an index). With data parallelism the rows are first split over dp,
then that share over TP (DTensor's order for ``(Shard(0), Shard(0))`` on the ``(dp, tp)``
mesh), and the embedding and head are never gathered: the dp ranks exchange token ids and
hidden states instead (activation-sized), each looks up or multiplies by its own rows, and
the weight gradient is complete on the rank that holds the rows.

The loss never materialises full logits: a max, a sum of exponentials and the target logit
are combined with three ``[T]`` all-reduces per group the vocabulary is split over; the
backward needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boostlr.models.placement import chunk_range
from boostlr.parallel.collectives import (
    GroupComm,
    all_reduce_,
    gather_from_group,
    reduce_from_group,
    reduce_scatter_to_group,
)


@dataclass(frozen=True)
class VocabSplit:
    """This rank's vocabulary rows ``[start, end)`` and the groups the others are spread over.

    ``groups`` lists only groups of more than one rank; the loss statistics are combined over
    each in turn (max of maxes, sum of sums: the order of groups does not matter).
    """

    vocab_size: int
    start: int
    end: int
    groups: tuple[GroupComm, ...] = ()

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.vocab_size


def vocab_split(vocab_size: int, tp: GroupComm | None, dp: GroupComm | None = None) -> VocabSplit:
    """Rows chunked over ``dp`` first, then that chunk over ``tp`` (either may be ``None``)."""
    start, end, groups = 0, vocab_size, []
    for comm in (dp, tp):
        if comm is not None and comm.size > 1:
            lo, hi = chunk_range(end - start, comm.rank, comm.size)
            start, end = start + lo, start + hi
            groups.append(comm)
    return VocabSplit(vocab_size, start, end, tuple(groups))


def vocab_range(vocab_size: int, comm: GroupComm) -> tuple[int, int]:
    """This TP rank's rows (vocabulary split over ``comm`` only)."""
    split = vocab_split(vocab_size, comm)
    return split.start, split.end


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def gather_batch(x: Tensor, dp: GroupComm | None, tag: str) -> Tensor:
    """Every dp rank's micro-batch stacked along dim 0 (the vocabulary-split head's input).

    The loss over the gathered batch is the dp mean of the ranks' mean losses, so the
    gradient each rank's rows receive is ``1/dp`` of its own loss's; the backward
    reduce-scatters the partial gradients (one per vocabulary slice) and scales them back by
    ``dp``: every rank's blocks see the gradient of their own micro-batch's mean loss, which
    data parallelism then averages, as without the split.
    """
    if dp is None or dp.size == 1:
        return x
    if x.requires_grad:
        x = _ScaleGrad.apply(x, float(dp.size))
    return gather_from_group(x, dp, tag, dim=0, grad="reduce_scatter")


def vocab_parallel_embedding(
    tokens: Tensor,
    weight: Tensor,
    split: VocabSplit,
    dp: GroupComm | None = None,
    tp: GroupComm | None = None,
) -> Tensor:
    """Look up this rank's rows of the vocabulary, zeros for the rest, and sum the slices.

    ``weight`` holds rows ``[split.start, split.end)``. With ``dp`` the rows are split over
    dp: the ids of every dp rank are gathered, looked up here and the partial embeddings
    reduce-scattered back to their rank; the backward gathers the output gradients, scaled by
    ``1/dp`` so the weight gradient is the dp mean that data parallelism takes of every other
    gradient. With ``tp`` the rows (not the columns) are split over TP as well: the slices
    are then all-reduced over ``tp``.
    """
    dp_size = 1 if dp is None else dp.size
    if dp_size > 1:
        tokens = gather_from_group(tokens, dp, "embed_ids", dim=0)
    if split.whole:
        out = F.embedding(tokens, weight)
    elif split.rows == 0:  # no rows here (more ranks than chunks): contribute zeros
        # weight.sum() is 0 but keeps the empty weight in the graph, so its (empty) gradient
        # exists on this rank like on every other one.
        out = weight.new_zeros(*tokens.shape, weight.shape[-1]) + weight.sum()
    else:
        outside = (tokens < split.start) | (tokens >= split.end)
        local = (tokens - split.start).masked_fill(outside, 0)
        out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    # The start of the fp32 residual stream (docs/precision.md), whatever dtype the rows are
    # used in; its sums over dp and tp below add one row to zeros: exact in any dtype.
    out = out.float()
    if dp_size > 1:
        out = reduce_scatter_to_group(out, dp, "embed", dim=0)
        if out.requires_grad:
            out = _ScaleGrad.apply(out, 1.0 / dp_size)
    if tp is not None:
        out = reduce_from_group(out, tp, "embed")
    return out


def combine_(x: Tensor, split: VocabSplit, tag: str, op=dist.ReduceOp.SUM) -> Tensor:
    """All-reduce a per-row statistic over every group the vocabulary is split over."""
    for comm in split.groups:
        all_reduce_(x, comm, tag, op=op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy over logits split along the vocabulary."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, split: VocabSplit):  # type: ignore[override]
        start, end = split.start, split.end
        ctx.dtype = logits.dtype
        logits = logits.float()
        # amax of an empty slice (more ranks than rows) is -inf, the identity of MAX.
        row_max = logits.amax(dim=-1) if end > start else logits.new_full(logits.shape[:1], -1e30)
        combine_(row_max, split, "ce_max", op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        combine_(sum_exp, split, "ce_sum_exp")
        inside = (targets >= start) & (targets < end)
        local_t = (targets - start).masked_fill(~inside, 0)
        if end > start:
            picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
            target_logit = torch.where(inside, picked, 0.0)
        else:  # an empty slice holds no target (index 0 would be out of range)
            target_logit = logits.new_zeros(logits.shape[:1])
        combine_(target_logit, split, "ce_target")
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), inside, local_t)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        softmax, inside, local_t = ctx.saved_tensors
        g = softmax.clone()
        if g.shape[-1] > 0:  # an empty slice has no logits, hence no target to subtract
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, local_t] -= inside.to(g.dtype)
        return (g * (grad / g.shape[0])).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, split: VocabSplit) -> Tensor:
    """``logits [N, rows]`` (this rank's vocab slice), ``targets [N]`` -> mean loss."""
    if not split.groups:
        if logits.shape[-1] != split.vocab_size:  # a no-op slice would still cost a zero-fill
            logits = logits[:, : split.vocab_size]
        return F.cross_entropy(logits.float(), targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, split)
