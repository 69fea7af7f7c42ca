"""The routed experts' dispatch math, once: sort the copies by expert, run every expert GEMM
as one grouped call, weight and sum the results back per token.

This file imports torch only. boostlr's MoE layer (:mod:`boostlr.models.moe_dispatch`,
:mod:`boostlr.models.moe_experts`, :mod:`boostlr.parallel.expert_parallel`) imports it, and
an MoE export copies it byte for byte beside its remote code
(``modeling_boostlr_moe.py`` imports it relatively), so a transformers-loaded model runs the
very same dispatch without boostlr installed.

The routed copies arrive as a routing map of three flat tensors (boostlr's
:class:`~boostlr.models.moe_routing.Routing`, passed here as plain tensors so this file needs
no boostlr): copy ``c`` sends token ``token[c]`` to expert ``expert[c]`` with weight
``weight[c]``, in priority order (:func:`top_k_copies` lists a top-k router's choices so).
Every form computes ``out[t] = Σ_{c: token[c] = t} weight[c] · expert_{expert[c]}(payload[t])``:

- **Grouped** (:func:`dropless`, :func:`run_experts` with ``grouped``): the copies are
  sorted by expert once; each stacked weight ``[E, d_out, d_in]`` is applied to
  all the sorted rows by one ``torch.nn.functional.grouped_mm`` with the int32 cumulative
  row counts ``offs`` on the device (:func:`stacked_linear`), and its backward is two more
  grouped calls. The row count (the number of copies) is fixed, so nothing is read back to
  the host; there is no per-expert indexing of a weight stack (``stack[e]``'s backward
  would zero-fill a whole-stack gradient per expert) and no loop over experts: the op
  count does not depend on ``E``.
- **Padded** (``grouped`` false: where the device has no grouped kernel for the dtype or
  the widths, or torch's would read the offsets back itself): the sorted rows are
  scattered into one ``[E, rows, width]`` buffer whose ``rows`` is the busiest expert's
  count (one host read, ``max_rows``), and every factor is one batched GEMM over it; no
  copy is dropped.
- **Capacity** (:func:`with_capacity`): ``[E, capacity, width]`` with a fixed ``capacity``:
  fixed shapes, one batched GEMM per factor, no host read; copies past an expert's capacity
  are dropped (they add nothing) and counted.

An expert function ``fn(x, offs)`` runs the experts: on sorted rows ``x [rows, width]`` with
``offs`` (grouped), or on ``x [E, rows, width]`` with ``offs=None`` (batched; a
``[tokens, width]`` input is broadcast to every expert, as the shared experts run).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: ``fn(x, offs) -> y``: the experts on sorted rows (``offs``) or batched (``offs=None``).
ExpertFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
#: The dtypes torch's grouped GEMM takes (``grouped_mm`` refuses float64).
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The grouped kernels want every row stride a multiple of 16 bytes.
_ALIGN_BYTES = 16


def grouped_widths_fit(widths: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether every GEMM width (``d_in``, ``d_out`` of each factor) keeps the grouped
    kernel's 16-byte row alignment in ``dtype``, and the dtype is one it takes."""
    if dtype not in GROUPED_DTYPES:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(w * size % _ALIGN_BYTES == 0 for w in widths)


def expert_counts(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Routed copies per expert, ``[experts]`` int64 on the device.

    A scatter-add, not ``torch.bincount``: on CUDA bincount reads the largest index back to
    size its output, a host sync the dispatch must not add.
    """
    flat = idx.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=idx.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for every expert ``e`` in one grouped GEMM;
    the backward is two grouped GEMMs (input and weight gradients).

    A function of its own rather than ``grouped_mm``'s autograd: the incoming gradient is
    made contiguous here (the kernel refuses expanded strides), and the weight gradient is
    one ``[E, d_out, d_in]`` tensor written group by group.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offs)
        return F.grouped_mm(x, w.mT, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        gx = F.grouped_mm(grad, w, offs=offs) if ctx.needs_input_grad[0] else None
        gw = F.grouped_mm(grad.t(), x, offs=offs) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def expert_product(gate: torch.Tensor, up: torch.Tensor, form: str) -> torch.Tensor:
    """``silu(g) ⊙ u`` (swiglu) or ``g ⊙ u`` (lowrank-only), as the dense MLP's product."""
    return F.silu(gate) * up if form == "swiglu" else gate * up


class _ProductLinear(torch.autograd.Function):
    """``stacked_linear(expert_product(gate, up), w, offs)`` that keeps ``gate`` and ``up``
    for the backward and recomputes the product there (one elementwise pass).

    Autograd would also keep the product (the GEMM's input) and, for swiglu, ``silu(gate)``:
    one or two more ``[copies, f_e]`` tensors per MoE layer, as wide as the experts' largest
    activations, held from the forward to the backward. The backward is the one autograd
    runs, op for op (``silu_backward`` of ``grad · up``; the GEMMs as
    :class:`_GroupedLinear`'s), so the gradients are the same numbers.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None,
        form: str,
    ) -> torch.Tensor:  # fmt: skip
        h = expert_product(gate, up, form).to(w.dtype)
        ctx.form = form
        ctx.save_for_backward(gate, up, w, offs)
        return torch.matmul(h, w.mT) if offs is None else F.grouped_mm(h, w.mT, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gate, up, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        act = F.silu(gate) if ctx.form == "swiglu" else gate
        gw = None
        if ctx.needs_input_grad[2]:
            h = (act * up).to(w.dtype)
            if offs is None:  # batched [E, n, f]: matmul's backward, in its order
                gw = torch.matmul(h.mT, grad).mT
            else:
                gw = F.grouped_mm(grad.t(), h, offs=offs)
            del h  # before the input gradients: the backward's peak is every layer's
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, gw, None, None
        gh = torch.matmul(grad, w) if offs is None else F.grouped_mm(grad, w, offs=offs)
        gh = gh.to(torch.promote_types(gate.dtype, up.dtype))
        # The product's backward as autograd's mul runs it: each factor's gradient in that
        # factor's dtype (a bf16 gate's before silu_backward).
        g_up = (gh * act).to(up.dtype) if ctx.needs_input_grad[1] else None
        g_gate = None
        if ctx.needs_input_grad[0]:
            g_act = (gh * up).to(act.dtype)
            g_gate = torch.ops.aten.silu_backward(g_act, gate) if ctx.form == "swiglu" else g_act
        return g_gate, g_up, gw, None, None


def product_linear(
    gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, form: str
) -> torch.Tensor:
    """:func:`stacked_linear` of ``expert_product(gate, up, form)``, the product not kept for
    the backward (:class:`_ProductLinear`). Without gradients it is the plain composition."""
    if not torch.is_grad_enabled() or not (
        gate.requires_grad or up.requires_grad or w.requires_grad
    ):
        return stacked_linear(expert_product(gate, up, form), w, offs)
    return _ProductLinear.apply(gate, up, w, offs, form)


def stacked_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """The stacked weight ``w [E, d_out, d_in]`` on ``x``: grouped over sorted rows
    ``x [rows, d_in]`` ending at ``offs``, or (``offs=None``) batched over ``x [E, n, d_in]``
    or broadcast from ``x [n, d_in]`` to ``[E, n, d_out]``.

    The grouped form computes in ``w``'s dtype (the caller's weight is already the autocast
    copy under autocast), so a bf16 run's rows are bf16 whatever dtype they arrived in.
    """
    if offs is None:
        return torch.matmul(x, w.mT)
    return _GroupedLinear.apply(x.to(w.dtype), w, offs)


def top_k_copies(
    idx: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The copies ``(token, expert, weight)`` of each token's ``k`` choices ``idx, weights
    [tokens, k]``, in GShard's priority: every token's first choice (in token order), then
    every second choice, ..."""
    tokens, k = idx.shape
    token = torch.arange(tokens, device=idx.device).repeat(k)
    return token, idx.t().reshape(-1), weights.t().reshape(-1)


def sort_by_expert(expert: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The copies sorted by expert (their order kept within an expert): ``(order, offs)``;
    copy ``order[i]`` is sorted row ``i``; ``offs`` (int32 ``[E]``) ends each expert's rows.
    All on the device: nothing is read back (the row count, the number of copies, is
    known)."""
    order = torch.argsort(expert, stable=True)
    offs = expert_counts(expert, experts).cumsum(0).to(torch.int32)
    return order, offs


def run_experts(
    apply: ExpertFn,
    x: torch.Tensor,
    offs: torch.Tensor | None,
    grouped: bool,
    max_rows: Callable[[torch.Tensor], int],
) -> torch.Tensor:
    """``apply(x, offs)``, the experts' math, where the grouped kernel runs (``grouped``), on
    a batched input (``offs=None``) too; else on sorted rows the padded form: the busiest
    expert's row count (``max_rows(counts)``, a host read the caller counts) sizes one
    ``[E, rows, width]`` buffer, and ``apply`` runs batched over it (one GEMM per factor)."""
    if offs is None or grouped:
        return apply(x, offs)
    experts, n = offs.numel(), x.shape[0]
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    cap = max(1, max_rows(counts))
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    slot = expert * cap + torch.arange(n, device=x.device) - (ends - counts)[expert]
    buf = x.new_zeros(experts * cap, x.shape[-1]).index_copy(0, slot, x)
    return apply(buf.view(experts, cap, -1), None).reshape(experts * cap, -1)[slot]


def combine(out: torch.Tensor, w: torch.Tensor, token: torch.Tensor, tokens: int) -> torch.Tensor:
    """``Σ w · out`` per token (row ``i`` of ``out`` and weight ``w[i]`` belong to token
    ``token[i]``), summed in fp32 at least, so a bf16 run's k results are added without
    rounding between them; returned in ``out``'s dtype."""
    acc = torch.promote_types(out.dtype, torch.float32)
    weighted = out.to(acc) * w.unsqueeze(-1).to(acc)
    combined = weighted.new_zeros(tokens, out.shape[-1]).index_add(0, token, weighted)
    return combined.to(out.dtype)


def dropless(
    payload: torch.Tensor,
    token: torch.Tensor,
    expert: torch.Tensor,
    weight: torch.Tensor,
    experts: int,
    fn: ExpertFn,
) -> torch.Tensor:
    """Every copy computed: sorted by expert once, the experts on the sorted rows
    (``fn(rows, offs)``), the results weighted and summed per token."""
    order, offs = sort_by_expert(expert, experts)
    token = token[order]
    return combine(fn(payload[token], offs), weight[order], token, payload.shape[0])


def capacity_of(tokens: int, k: int, experts: int, factor: float) -> int:
    """Rows per expert at capacity factor ``factor``: ``ceil(factor · tokens · k / E)``."""
    return max(1, math.ceil(factor * tokens * k / experts))


def queue_positions(expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each copy's place in its expert's queue, the copies taken in their (priority) order;
    ``counts`` is :func:`expert_counts` of ``expert``. One stable sort by expert, not a
    ``[copies, E]`` one-hot cumulative sum: the same places."""
    order = torch.argsort(expert, stable=True)
    start = counts.cumsum(0) - counts
    place = torch.arange(expert.numel(), device=expert.device) - start[expert[order]]
    return torch.empty_like(place).scatter_(0, order, place)


def with_capacity(
    payload: torch.Tensor,
    token: torch.Tensor,
    expert: torch.Tensor,
    weight: torch.Tensor,
    experts: int,
    capacity: int,
    fn: ExpertFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed shapes: each expert takes at most ``capacity`` copies; returns (combined, dropped).

    Copies are served in their priority order (a top-k router's is GShard's: first choices
    first, then second choices and so on, within a choice in token order), so which copies
    are dropped is a fixed function of the routing. A copy's place in its expert's queue
    comes from one stable sort of the copies by expert (no ``[copies, E]`` one-hot).
    ``dropped`` is a 0-d int64 device tensor (no sync).
    """
    position = queue_positions(expert, expert_counts(expert, experts))
    kept = position < capacity
    # Dropped copies go to one spare row past the experts' rows: no expert reads it, and it
    # reads back as zeros, so a dropped copy adds nothing (and its weight gets no gradient).
    row = torch.where(kept, expert * capacity + position, experts * capacity)
    rows = payload.new_zeros(experts * capacity + 1, payload.shape[-1])
    rows = rows.index_add(0, row, payload[token])
    out = fn(rows[:-1].view(experts, capacity, -1), None).reshape(experts * capacity, -1)
    out = torch.cat([out, out.new_zeros(1, out.shape[-1])])
    combined = combine(out[row], weight, token, payload.shape[0])
    return combined, (~kept).sum()
