"""Small GPU costs removed without changing results: GQA in half precision through SDPA's
``enable_gqa`` instead of copies of K/V made by ``repeat_interleave`` (the formula it
replaced, which fp32 keeps: CUDA's fused fp32 kernels cannot group heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boostlr.config import build_config
from boostlr.models import llama
from boostlr.models.llama import apply_rope, causal_attention, rope_tables

HEAD_DIM = 16


def repeated_kv_attention(q, k, v, rope, head_dim: int) -> torch.Tensor:
    """The formula before ``enable_gqa``: each K/V head copied for its group of queries."""
    b, s, _ = q.shape
    q = q.view(b, s, -1, head_dim).transpose(1, 2)
    k = k.view(b, s, -1, head_dim).transpose(1, 2)
    v = v.view(b, s, -1, head_dim).transpose(1, 2)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


def _inputs(heads: int, kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, s = 2, 24
    shapes = [(b, s, heads * HEAD_DIM), (b, s, kv_heads * HEAD_DIM), (b, s, kv_heads * HEAD_DIM)]
    tensors = [torch.randn(*shape, generator=gen).requires_grad_() for shape in shapes]
    shape = {"model.dim": heads * HEAD_DIM, "model.n_heads": heads, "model.n_kv_heads": kv_heads}
    cfg = build_config(
        overrides=[("model.preset", "tiny")] + [(k, str(v)) for k, v in shape.items()]
    )
    assert cfg.model.head_dim == HEAD_DIM
    return tensors, rope_tables(cfg.model, s)


def _run(fn, tensors, rope, dtype):
    q, k, v = (t.to(dtype) for t in tensors)
    out = fn(q, k, v, rope, HEAD_DIM)
    grads = torch.autograd.grad(out.float().square().sum(), tensors)
    return out, grads


def test_half_precision_takes_the_kernels_gqa_on_this_torch() -> None:
    assert llama.SDPA_GQA  # torch >= 2.5: the copies are gone, not merely tested
    assert llama.gqa_in_kernel(torch.zeros(1, dtype=torch.bfloat16))
    assert not llama.gqa_in_kernel(torch.zeros(1))  # fp32: CUDA's fused kernels lack it


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 1), (6, 3), (4, 4)])
def test_fp32_gqa_equals_repeated_kv_bit_for_bit(heads: int, kv_heads: int) -> None:
    tensors, rope = _inputs(heads, kv_heads)
    out, grads = _run(causal_attention, tensors, rope, torch.float32)
    ref_out, ref_grads = _run(repeated_kv_attention, tensors, rope, torch.float32)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_bf16_gqa_keeps_the_forward_and_the_gradients_accuracy() -> None:
    """bf16: the forward is bit-equal; K/V gradients sum a head group in another order, so
    they differ by bf16 rounding, and are no further from the fp32 gradient than before."""
    tensors, rope = _inputs(8, 2, seed=1)
    out, grads = _run(causal_attention, tensors, rope, torch.bfloat16)
    ref_out, ref_grads = _run(repeated_kv_attention, tensors, rope, torch.bfloat16)
    _, exact = _run(repeated_kv_attention, tensors, rope, torch.float32)
    assert torch.equal(out, ref_out)
    for g, r, e in zip(grads, ref_grads, exact, strict=True):
        new, old = ((g - e).norm() / e.norm()).item(), ((r - e).norm() / e.norm()).item()
        assert new < 2e-2 and new < 2 * old + 1e-3, (new, old)
