"""Vocab-parallel embedding, LM head and cross-entropy (Megatron style).

Each TP rank owns a contiguous range of (padded) vocabulary rows. The loss never
materialises full logits: a max, a sum of exponentials and the target logit are combined
with three ``[T]`` all-reduces; the backward needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boostlr.parallel.collectives import GroupComm, all_reduce_, reduce_from_group


def vocab_range(local_rows: int, comm: GroupComm) -> tuple[int, int]:
    start = comm.rank * local_rows
    return start, start + local_rows


def vocab_parallel_embedding(tokens: Tensor, weight: Tensor, comm: GroupComm) -> Tensor:
    """Look up the rank's rows, zero the rest, all-reduce ``[T, d]``."""
    start, end = vocab_range(weight.shape[0], comm)
    outside = (tokens < start) | (tokens >= end)
    local = (tokens - start).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_group(out, comm, "embed")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy over logits split along the vocabulary."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: int, comm: GroupComm):  # type: ignore[override]
        start, end = vocab_range(logits.shape[-1], comm)
        ctx.dtype = logits.dtype
        logits = logits.float()
        if end > vocab_size:  # padded rows are not tokens: exclude them from the softmax
            logits = logits.clone()
            logits[:, max(0, vocab_size - start) :] = float("-inf")
        row_max = logits.max(dim=-1).values
        all_reduce_(row_max, comm, "ce_max", op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce_(sum_exp, comm, "ce_sum_exp")
        inside = (targets >= start) & (targets < end)
        local_t = (targets - start).masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        all_reduce_(target_logit, comm, "ce_target")
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), inside, local_t)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        softmax, inside, local_t = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= inside.to(g.dtype)
        return (g * (grad / g.shape[0])).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, vocab_size: int, comm: GroupComm
) -> Tensor:
    """``logits [N, V/t]`` (this rank's vocab slice), ``targets [N]`` -> mean loss."""
    if comm.size == 1:
        return F.cross_entropy(logits.float()[:, :vocab_size], targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_size, comm)
