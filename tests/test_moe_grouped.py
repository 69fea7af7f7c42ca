"""The routed experts as grouped computations (boostlr.hf.moe_grouped): one grouped GEMM per
factor over the copies sorted by expert, so the work per MoE layer does not grow with E.

Counted with torch's profiler on real forwards and backwards: no per-expert indexing of a
weight stack (``stack[e]``, whose backward zero-fills a whole-stack gradient per expert),
and the same aten ops at E = 8 and E = 64. The padded fallback (for a device without a
grouped kernel) computes what the grouped form computes, gradients included.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from boostlr.config import ModelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.hf import moe_grouped
from boostlr.models import moe_experts
from boostlr.models.moe import MoEMLP, make_moe_mlp

CASES = [("cola", "latent"), ("svd", "latent"), ("lax", "latent"), ("cola", "hidden")]
CASES += [("full", "hidden")]


def layer(arch: str, dispatch: str, experts: int, seed: int = 0, **kw) -> MoEMLP:
    """One MoE layer (block 0) of a small model, its weights drawn from ``seed``."""
    cfg = ModelConfig(
        preset="tiny", dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, n_layers=2, rank=8,
        arch=arch, moe_experts=experts, moe_top_k=2, moe_ffn_dim=16, vocab_size=32,
        moe_dispatch=dispatch, mlp="swiglu" if arch == "full" else "lowrank-only", **kw,
    )  # fmt: skip
    cfg = resolve_model(cfg)
    validate_moe(cfg)
    m = make_moe_mlp(cfg, 0)  # block 0: LaX needs no previous latent
    assert m is not None
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return m


def aten_ops(m: MoEMLP, x: torch.Tensor) -> Counter:
    """The aten ops one forward and backward of ``m`` on ``x`` issues, by name: the
    outermost ones (what the layer and autograd call), not those an op runs inside itself
    (the CPU grouped kernel slices its groups in C++; on a GPU with the kernel it is one
    launch)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y, _ = m(x, None)
        y.square().sum().backward()
    return Counter(e.name for e in prof.events() if _outermost_aten(e))


def _outermost_aten(event) -> bool:
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


@pytest.mark.parametrize(("arch", "dispatch"), CASES)
def test_no_expert_is_indexed_out_of_its_stack(arch: str, dispatch: str) -> None:
    """No ``select`` of one expert's weights: its backward would zero-fill a gradient the
    size of the whole stack, once per expert (E² work)."""
    m = layer(arch, dispatch, experts=8)
    ops = aten_ops(m, torch.randn(2, 16, 32))
    assert ops["aten::select_backward"] == 0, ops["aten::select_backward"]
    assert ops["aten::_grouped_mm"] > 0  # the experts ran grouped


@pytest.mark.parametrize(("arch", "dispatch"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aten_ops_per_layer_do_not_grow_with_the_experts(
    arch: str, dispatch: str, dtype: torch.dtype
) -> None:
    """Forward + backward of an MoE layer: the same aten ops at E = 8 and E = 64 (the same
    tokens, k and widths), fp32 and under bf16 autocast."""
    x = torch.randn(2, 64, 32)
    counts = []
    for experts in (8, 64):
        m = layer(arch, dispatch, experts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            counts.append(aten_ops(m, x))
    assert counts[0] == counts[1], counts[0] - counts[1] or counts[1] - counts[0]


def _grads(m: MoEMLP, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m.zero_grad()
    y, _ = m(x, None)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize(("arch", "dispatch"), CASES)
def test_the_padded_fallback_computes_the_grouped_result(
    arch: str, dispatch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the platform has no grouped kernel the experts run padded (one batched GEMM per
    factor over ``[E, busiest expert's rows, width]``): the same outputs and gradients, an
    expert that got no copy included (zero gradient)."""
    m = layer(arch, dispatch, experts=8, moe_shared=1)
    x = torch.randn(1, 5, 32)  # 10 copies over 8 experts: some get none
    y, grads = _grads(m, x)
    monkeypatch.setattr(moe_experts, "grouped_here", lambda *_: False)
    y_pad, grads_pad = _grads(m, x)
    torch.testing.assert_close(y_pad, y, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(grads_pad[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_grouped_linear_matches_one_gemm_per_expert() -> None:
    """The grouped GEMM and its two backward GEMMs, against each expert's own GEMM on its
    slice; an empty expert gets a zero gradient, and an expanded incoming gradient (a
    ``sum()``'s) is taken."""
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 8, generator=gen, requires_grad=True)
    w = torch.randn(4, 12, 8, generator=gen, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = moe_grouped.stacked_linear(x, w, offs)
    y.sum().backward()
    gx, gw = x.grad, w.grad
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.cat(
        [chunk @ wr[e].T for e, chunk in enumerate(xr.split(counts))]
    )  # the old per-expert form
    ref.sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)
    assert not gw[1].any()


def test_grouped_widths_fit_the_kernels_alignment() -> None:
    """16-byte rows: fp32 widths multiple of 4, bf16 of 8; float64 never (no kernel)."""
    fit = moe_grouped.grouped_widths_fit
    assert fit((8, 16), torch.float32) and fit((8, 16), torch.bfloat16)
    assert not fit((8, 6), torch.float32) and not fit((4, 16), torch.bfloat16)
    assert not fit((8, 16), torch.float64)


DTYPES = {  # gate, up, w
    "fp32": (torch.float32,) * 3,
    "bf16": (torch.bfloat16,) * 3,
    "mixed": (torch.bfloat16, torch.float32, torch.float32),
}
NEEDS = {"all": (True, True, True), "weight": (False, False, True), "gate": (True, False, False)}


def _product_case(grouped: bool, dtypes: tuple[torch.dtype, ...]):
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]
    rows, f, out = sum(counts), 16, 8
    shape = (rows, f) if grouped else (4, 6, f)
    gate = torch.randn(shape, generator=gen).to(dtypes[0])
    up = torch.randn(shape, generator=gen).to(dtypes[1])
    w = torch.randn(4, out, f, generator=gen).to(dtypes[2])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32) if grouped else None
    probe = torch.randn(*shape[:-1], out, generator=gen).to(dtypes[2])
    return (gate, up, w), offs, probe


def _run(fn, tensors, needs, probe) -> list[torch.Tensor | None]:
    leaves = [t.clone().requires_grad_(n) for t, n in zip(tensors, needs, strict=True)]
    y = fn(*leaves)
    (y * probe).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def _unfused(offs, form):
    return lambda g, u, w: moe_grouped.stacked_linear(
        moe_grouped.expert_product(g, u, form), w, offs
    )


@pytest.mark.parametrize("form", ["swiglu", "lowrank-only"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("needs", list(NEEDS))
def test_product_linear_is_the_composition_op_for_op(
    form: str, grouped: bool, dtypes: str, needs: str
) -> None:
    """``product_linear`` recomputes the product in its backward instead of keeping it:
    the output and the gradients asked for are the unfused composition's, bit for bit (the
    backward runs autograd's ops, each factor's gradient in its own dtype), grouped over
    sorted rows and batched; fp32, bf16, a bf16 gate beside fp32 up and weights; every
    input, the weight alone, the gate alone needing a gradient."""
    tensors, offs, probe = _product_case(grouped, DTYPES[dtypes])
    fused = _run(
        lambda g, u, w: moe_grouped.product_linear(g, u, w, offs, form),
        tensors,
        NEEDS[needs],
        probe,
    )
    unfused = _run(_unfused(offs, form), tensors, NEEDS[needs], probe)
    for name, a, b in zip(("out", "gate", "up", "w"), fused, unfused, strict=True):
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name


@pytest.mark.parametrize("form", ["swiglu", "lowrank-only"])
def test_product_linear_compiles_without_a_graph_break(form: str) -> None:
    """``train.compile`` traces the function whole (``fullgraph``), forward and backward, bf16
    grouped (the compiled grouped kernel's dtype), with the eager results."""
    tensors, offs, probe = _product_case(True, DTYPES["bf16"])
    needs = NEEDS["all"]

    def fn(g, u, w):
        return moe_grouped.product_linear(g, u, w, offs, form)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager = _run(fn, tensors, needs, probe)
    for a, b in zip(_run(compiled, tensors, needs, probe), eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _saved_activation_bytes(m: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps from ``m``'s forward for its backward, parameters and the input
    left out, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    params.add(x.untyped_storage().data_ptr())
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, None)[0].sum()
    return sum(kept.values())


@pytest.mark.parametrize(
    ("arch", "dispatch", "dropped"),
    [("cola", "latent", 1), ("cola", "hidden", 1), ("full", "hidden", 2)],
)
def test_experts_keep_no_product_for_the_backward(arch: str, dispatch: str, dropped: int) -> None:
    """The experts' widest activations are ``[copies, f_e]``: gate and up are kept for the
    backward, their product is not (recomputed there), nor swiglu's ``silu(gate)``. Counted
    against the whole layer's kept bytes with the product's GEMM unfused."""
    m = layer(arch, dispatch, experts=8)
    x = torch.randn(2, 16, 32)
    kept = _saved_activation_bytes(m, x)
    weights = dict(m.experts.named_parameters())
    f_e = weights.get("up_proj.weight", weights.get("up_proj.up.weight")).shape[1]
    copies = x.shape[0] * x.shape[1] * m.router.top_k
    orig = moe_experts.product_linear
    try:
        moe_experts.product_linear = lambda g, u, w, offs, form: _unfused(offs, form)(g, u, w)
        unfused = _saved_activation_bytes(m, x)
    finally:
        moe_experts.product_linear = orig
    assert unfused - kept == dropped * copies * f_e * 4, (unfused, kept, copies, f_e)
