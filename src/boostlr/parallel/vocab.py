"""Vocab-parallel embedding, LM head and cross-entropy (Megatron style).

Each TP rank owns a contiguous range of vocabulary rows (``torch.chunk`` order: the last
ranks may hold fewer rows when TP does not divide the vocabulary, or none at all, e.g. V=5 at
TP=4 splits 2, 2, 1, 0; an empty slice contributes zeros, never an index). The loss never
materialises full logits: a max, a sum of exponentials and the target logit are combined
with three ``[T]`` all-reduces; the backward needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boostlr.parallel.collectives import GroupComm, all_reduce_, reduce_from_group
from boostlr.parallel.sharding import chunk_range


def vocab_range(vocab_size: int, comm: GroupComm) -> tuple[int, int]:
    return chunk_range(vocab_size, comm.rank, comm.size)


def vocab_parallel_embedding(
    tokens: Tensor, weight: Tensor, vocab_size: int, comm: GroupComm
) -> Tensor:
    """Look up the rank's rows, zero the rest, all-reduce ``[T, d]``."""
    start, end = vocab_range(vocab_size, comm)
    if end == start:  # no rows here (more ranks than chunks): contribute zeros
        # weight.sum() is 0 but keeps the empty weight in the graph, so its (empty) gradient
        # exists on this rank like on every other one.
        out = weight.new_zeros(*tokens.shape, weight.shape[-1]) + weight.sum()
        return reduce_from_group(out, comm, "embed")
    outside = (tokens < start) | (tokens >= end)
    local = (tokens - start).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_group(out, comm, "embed")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy over logits split along the vocabulary."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: int, comm: GroupComm):  # type: ignore[override]
        start, end = vocab_range(vocab_size, comm)
        ctx.dtype = logits.dtype
        logits = logits.float()
        # amax of an empty slice (more ranks than rows) is -inf, the identity of MAX.
        row_max = logits.amax(dim=-1) if end > start else logits.new_full(logits.shape[:1], -1e30)
        all_reduce_(row_max, comm, "ce_max", op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce_(sum_exp, comm, "ce_sum_exp")
        inside = (targets >= start) & (targets < end)
        local_t = (targets - start).masked_fill(~inside, 0)
        if end > start:
            picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
            target_logit = torch.where(inside, picked, 0.0)
        else:  # an empty slice holds no target (index 0 would be out of range)
            target_logit = logits.new_zeros(logits.shape[:1])
        all_reduce_(target_logit, comm, "ce_target")
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
        return (g * (grad / g.shape[0])).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, vocab_size: int, comm: GroupComm
) -> Tensor:
    """``logits [N, V/t]`` (this rank's vocab slice), ``targets [N]`` -> mean loss."""
    if comm.size == 1:
        if logits.shape[-1] != vocab_size:  # a no-op slice would still cost a zero-fill in bwd
            logits = logits[:, :vocab_size]
        return F.cross_entropy(logits.float(), targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_size, comm)
