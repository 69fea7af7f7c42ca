"""The LM head and its cross-entropy as one step: logits are written once and never kept.

The unfused path keeps the logits, their fp32 copy, the log-softmax and a zero-filled
gradient, each ``[N, V]``: at a 32k vocabulary that is most of a small model's activation
memory and several passes over it. Here the head GEMM writes each chunk of rows into one
buffer, which one fused log-softmax kernel per chunk turns into the gradient
``softmax − onehot`` (computed in fp32, rounded once; its 1/N is applied to the narrow
operands in the backward); the backward is two GEMMs on that buffer. One buffer in the
compute dtype is all that is kept.

With the vocabulary split over ranks (:class:`~boostlr.parallel.vocab.VocabSplit`), each
rank computes its slice's log-sum-exps and combines them with the same three ``[N]``
all-reduces per group as :func:`boostlr.parallel.vocab.vocab_parallel_cross_entropy` (a max,
a sum of exponentials, the target logit); a second pass over the buffer (which holds the
logits until then) turns each chunk into its slice of the global softmax. The backward needs
no communication. Same math as the unfused path; only the order of floating-point sums
differs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boostlr.parallel.vocab import VocabSplit, combine_

#: fp32 logits per chunk: few chunks (each is a handful of kernel launches), a bounded fp32
#: temporary under autocast (64 MiB is 524 rows of a 32k vocabulary).
CHUNK_BYTES = 64 * 2**20


def chunk_rows(cols: int) -> int:
    """Rows per chunk for ``cols`` vocabulary columns on this rank."""
    return max(1, CHUNK_BYTES // (4 * max(cols, 1)))


class _HeadCrossEntropy(torch.autograd.Function):
    """``mean_t CE(h_t Wᵀ, y_t)`` over this rank's vocabulary slice ``W [V/t, d]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        split: VocabSplit,
        rows: int,
    ) -> Tensor:
        start, end = split.start, split.end
        split_over_ranks = bool(split.groups)
        cols = end - start
        device = h.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else h.dtype
        n = h.shape[0]
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # not in evaluation
        with torch.autocast(device, enabled=False):
            # A no-op slice would still cost a zero-filled weight gradient in the backward.
            w_c = weight if weight.shape[0] == cols else weight[:cols]
            h_c, w_c = h.to(dtype), w_c.to(dtype)
            grad = torch.empty(n, cols, dtype=dtype, device=h.device)
            # This slice's log-sum-exp per row (vocab-parallel only); an empty slice keeps
            # -inf: no mass, and the identity of MAX.
            lse = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
            inside = (targets >= start) & (targets < end)
            local_t = (targets - start).masked_fill(~inside, 0)
            target_logit = torch.zeros(n, dtype=torch.float32, device=h.device)
            chunks = [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)] if cols else []
            for r0, r1 in chunks:
                logits = torch.mm(h_c[r0:r1], w_c.t(), out=grad[r0:r1])
                # One fused row-wise kernel (fp32 math); its exp is the local softmax.
                log_p = torch.log_softmax(logits, -1, dtype=torch.float32)
                t = local_t[r0:r1, None]
                target_logit[r0:r1] = torch.where(inside[r0:r1], log_p.gather(-1, t)[:, 0], 0.0)
                if split_over_ranks:  # this slice's log-sum-exp, exactly: max - log p(max)
                    top, arg = logits.max(-1, keepdim=True)
                    lse[r0:r1] = (top.float() - log_p.gather(-1, arg))[:, 0]
                elif grads:  # the log-sum-exp is the global one already
                    _store_gradient(logits, log_p, local_t[r0:r1], inside[r0:r1])
            if split_over_ranks:
                # target_logit holds log p_local(t) = l_t - lse on the owning rank.
                row_max = combine_(lse.clone(), split, "ce_max", op=dist.ReduceOp.MAX)
                sum_exp = combine_((lse - row_max).exp(), split, "ce_sum_exp")
                target_shifted = torch.where(inside, target_logit + lse - row_max, 0.0)
                combine_(target_shifted, split, "ce_target")
                log_sum = sum_exp.log()
                loss = (log_sum - target_shifted).mean()
                if grads:  # the buffer holds logits: this slice of the global softmax, in fp32
                    global_lse = (row_max + log_sum).unsqueeze(-1)
                    for r0, r1 in chunks:
                        logits = grad[r0:r1]
                        log_p = logits.float().sub_(global_lse[r0:r1])
                        _store_gradient(logits, log_p, local_t[r0:r1], inside[r0:r1])
            else:
                loss = -target_logit.mean()
        ctx.save_for_backward(grad, h, w_c)
        ctx.w_dtype, ctx.w_rows = weight.dtype, weight.shape[0]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):  # type: ignore[override]
        grad, h, w_c = ctx.saved_tensors
        scale = grad_loss / grad.shape[0]  # the mean's 1/n, on the two narrow operands
        grad_h = torch.mm(grad, w_c).float().mul_(scale).to(h.dtype)
        grad_w = torch.mm(grad.t(), (h * scale).to(grad.dtype)).to(ctx.w_dtype)
        if grad_w.shape[0] != ctx.w_rows:  # rows past the vocabulary get no gradient
            grad_w = F.pad(grad_w, (0, 0, 0, ctx.w_rows - grad_w.shape[0]))
        return grad_h, grad_w, None, None, None


def _store_gradient(out: Tensor, log_p: Tensor, local_t: Tensor, inside: Tensor) -> None:
    """``softmax - onehot`` of one chunk, computed in fp32 and rounded to ``out``'s dtype once.

    Subtracting the one-hot after rounding would lose the gradient of a confident token
    (bf16 rounds a probability of 0.999 to 1): the loss's statistics and its gradient are
    fp32 until they become a GEMM input (docs/precision.md). ``log_p`` is consumed.
    """
    p = log_p.exp_()
    rows = torch.arange(p.shape[0], device=p.device)
    p[rows, local_t] -= inside.to(p.dtype)
    out.copy_(p)


def head_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    split: VocabSplit,
    rows: int | None = None,
) -> Tensor:
    """Mean token cross-entropy of ``h [N, d] · weight [rows, d]ᵀ`` against ``targets [N]``.

    ``weight`` is this rank's vocabulary slice ``split`` (all of it on one rank); under
    autocast the GEMMs run in the autocast dtype and the softmax in fp32, as the unfused
    path does. ``rows`` per chunk: :func:`chunk_rows` unless given.
    """
    if rows is None:
        rows = chunk_rows(split.rows)
    return _HeadCrossEntropy.apply(h, weight, targets, split, rows)
