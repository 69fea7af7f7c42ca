"""Router memory and the MoE numerics under bf16 (docs/moe.md): the router keeps its input
for the backward in the compute dtype, not as an fp32 copy; the k results of a token are
summed in fp32; the capacity path builds no ``[k·T, E]`` temporaries."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from boostlr.config import ModelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models.moe import make_moe_mlp
from boostlr.models.moe_dispatch import dropless
from boostlr.models.moe_router import TopKRouter
from boostlr.models.moe_routing import top_k_routing


def _cfg(**kw) -> ModelConfig:
    base = dict(
        preset="tiny", dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, n_layers=2, rank=8,
        moe_experts=8, moe_top_k=2, moe_ffn_dim=16, vocab_size=32,
    )  # fmt: skip
    cfg = resolve_model(ModelConfig(**{**base, **kw}))
    validate_moe(cfg)
    return cfg


def _saved(fn) -> list[torch.Tensor]:
    """The tensors autograd keeps for the backward while ``fn()`` runs."""
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return kept


def test_the_router_keeps_its_input_in_the_compute_dtype() -> None:
    """Under bf16 autocast an fp32 ``[T, d]`` router input is kept as bf16 (half the bytes of
    an fp32 copy); the logits are still fp32 and the input gradient is the input's dtype."""
    cfg = _cfg()
    router = TopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(64, cfg.dim, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = _saved(lambda: router(x))
        route = router(x)
    inputs = [t for t in kept if t.shape == x.shape]
    assert inputs and all(t.dtype == torch.bfloat16 for t in inputs), [t.dtype for t in inputs]
    assert sum(t.numel() * t.element_size() for t in inputs) == x.numel() * 2
    assert route.weight.dtype == torch.float32
    route.weight.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.float32


def test_the_router_in_fp32_is_the_plain_linear() -> None:
    """Without autocast the router's logits and gradients are ``F.linear``'s, bit for bit."""
    cfg = _cfg()
    router = TopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(16, cfg.dim, requires_grad=True)
    route = router(x)
    route.weight.square().sum().backward()
    gx, gw = x.grad.clone(), router.weight.grad.clone()
    x.grad, router.weight.grad = None, None
    logits = torch.nn.functional.linear(x, router.weight)
    again = router.select(logits)
    assert torch.equal(again.weight, route.weight)
    again.weight.square().sum().backward()
    assert torch.equal(x.grad, gx) and torch.equal(router.weight.grad, gw)


def test_a_tokens_results_are_summed_in_fp32() -> None:
    """bf16 results of one token (identity experts) weighted and summed in fp32, rounded to
    bf16 once: the float64 sum rounded, where weighting each copy in bf16 rounds k + 1 times
    (some elements then land an ulp off)."""
    gen = torch.Generator().manual_seed(1)
    payload = torch.randn(4, 64, generator=gen).bfloat16()
    idx = torch.tensor([[0, 1, 2]]).repeat(4, 1)
    weights = torch.softmax(torch.randn(4, 3, generator=gen), -1)
    route = top_k_routing(idx, weights, torch.zeros(4, 3))
    out = dropless(payload, route, 3, lambda x, _: x)
    exact = (payload.double() * weights.double().sum(-1, keepdim=True)).bfloat16()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact)


@pytest.mark.parametrize("dispatch", ["latent", "hidden"])
def test_the_capacity_path_builds_no_copy_by_expert_table(dispatch: str) -> None:
    """No op of a capacity forward + backward takes a ``[k·T, E]`` tensor (the one-hot of
    every copy's expert and its running count, int64)."""
    cfg = _cfg(moe_capacity=1.0, moe_dispatch=dispatch, moe_experts=4)  # no width is 4
    m = make_moe_mlp(cfg, 0)
    assert m is not None
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    tokens = 40  # k·T = 80 copies over E = 4: an [80, 4] table would show
    x = torch.randn(2, tokens // 2, cfg.dim)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y, _ = m(x, None)
        y.sum().backward()
    table = [cfg.moe_top_k * tokens, cfg.moe_experts]
    seen = [e.name for e in prof.events() if table in [list(s) for s in e.input_shapes]]
    assert not seen, seen
    assert m.dropped is not None
