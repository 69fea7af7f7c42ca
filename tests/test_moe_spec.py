"""The MoE spec (``boostlr.specs.moe``) agrees with everything that acts on its facts: the
schema's sets, validation, the router, the layer's parameters and buffers, and the cost
model's widths; and the router -> dispatcher interface takes a router of another kind."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_moe_model import build, moe_cfg, payload_of, rel

from boostlr.analysis.moe import elements_per_copy, routed_widths
from boostlr.config import ARCHS, ModelConfig, resolve_model
from boostlr.config.schema import MOE_BALANCES, MOE_DISPATCHES
from boostlr.config.validate_moe import dispatch_of, validate_moe
from boostlr.errors import ConfigError
from boostlr.models.llama import build_model
from boostlr.models.moe import checkpointed_buffers, moe_layers
from boostlr.models.moe_dispatch import dropless, with_capacity
from boostlr.models.moe_router import TopKRouter
from boostlr.models.moe_routing import Routing
from boostlr.models.placement import MOE, param_kind
from boostlr.specs import moe as spec
from boostlr.specs.arch import arch_spec


def test_the_schema_sets_are_the_moe_specs() -> None:
    assert MOE_DISPATCHES == (spec.AUTO, *spec.DISPATCHES)
    assert MOE_BALANCES == tuple(spec.BALANCES)


@pytest.mark.parametrize(("arch", "dispatch"), list(itertools.product(ARCHS, spec.DISPATCHES)))
def test_validation_takes_what_the_dispatch_spec_takes(arch: str, dispatch: str) -> None:
    m = resolve_model(
        ModelConfig(preset="tiny", arch=arch, moe_experts=4, moe_ffn_dim=64, moe_dispatch=dispatch)
    )
    if spec.dispatch_spec(dispatch).takes(arch_spec(arch)):
        validate_moe(m)
        assert dispatch_of(m).name == dispatch
    else:
        with pytest.raises(ConfigError, match=f"moe_dispatch {dispatch}"):
            validate_moe(m)


def test_auto_picks_a_form_the_arch_takes() -> None:
    for name, arch in ((n, arch_spec(n)) for n in ARCHS):
        auto = spec.resolve_dispatch(spec.AUTO, arch)
        assert auto.takes(arch) and auto.shared_outer == arch.lowrank, name


def test_copy_widths_are_the_designs() -> None:
    """Design notes §9: 3r elements per routed copy under latent dispatch, 2d under hidden;
    the cost model's widths are the spec's."""
    assert spec.LATENT.copy_widths(4096, 1024) == (2048, 1024)
    assert spec.HIDDEN.copy_widths(4096, 1024) == (4096, 4096)
    for dispatch in spec.DISPATCHES:
        m = resolve_model(
            ModelConfig(
                preset="tiny", arch="cola", moe_experts=4, moe_ffn_dim=64, moe_dispatch=dispatch
            )
        )
        out, out_bytes, back, back_bytes = routed_widths(m, 2)
        assert (out, back) == spec.dispatch_spec(dispatch).copy_widths(m.dim, m.rank)
        assert (out_bytes, back_bytes) == spec.dispatch_spec(dispatch).copy_bytes(2)
        assert elements_per_copy(m) == (3 * m.rank if dispatch == "latent" else 2 * m.dim)


@pytest.mark.parametrize("balance", list(spec.BALANCES))
def test_the_router_and_the_layer_do_what_the_balance_spec_says(balance: str) -> None:
    b = spec.balance_spec(balance)
    m = build(moe_cfg(moe_balance=balance, moe_aux_coef=0.5), seed=3)
    assert hasattr(m.router, spec.BIAS_BUFFER) == b.selection_bias
    assert (m.aux_coef != 0) == b.balance_loss
    logits = torch.randn(6, 4)
    if b.selection_bias:
        getattr(m.router, spec.BIAS_BUFFER).zero_()
    scores = m.router.select(logits).scores
    want = torch.sigmoid(logits) if b.sigmoid_scores else torch.softmax(logits, -1)
    assert torch.allclose(scores, want / want.sum(-1, keepdim=True))


def test_the_parameter_names_are_the_specs() -> None:
    """The routed experts, the MoE parts and the saved buffer are what the spec names."""
    cfg = resolve_model(
        ModelConfig(
            preset="tiny",
            moe_experts=4,
            moe_ffn_dim=32,
            moe_shared=1,
            moe_dense_layers=1,
            vocab_size=64,
        )
    )
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    routed = {n for n in names if spec.is_routed_expert(n)}
    assert routed == {n for n in names if n.split(".")[3:4] == [spec.EXPERTS]} != set()
    parts = {n.split(".")[3] for n in names if param_kind(n) == MOE}
    assert parts == set(spec.MOE_PARTS)
    moe_blocks = {int(n.split(".")[1]) for n in names if param_kind(n) == MOE}
    assert moe_blocks == {i for i in range(cfg.n_layers) if spec.is_moe_layer(cfg, i)}
    saved = [n for n, _ in checkpointed_buffers(model)]
    assert saved == [f"layers.{i}.mlp.{spec.BALANCE_BIAS}" for i in sorted(moe_blocks)]
    assert len(moe_layers(model)) == spec.moe_layer_count(cfg, range(cfg.n_layers))


class ExpertChoiceRouter(TopKRouter):
    """A router of another kind, as its own module: each expert picks its ``c`` best tokens
    (a token may get any number of experts, none included)."""

    def select(self, logits: torch.Tensor) -> Routing:
        scores = torch.softmax(logits, dim=-1)
        tokens, experts = scores.shape
        per = max(1, tokens * self.top_k // experts)
        weight, token = torch.topk(scores.t(), per, dim=-1)  # [E, per]
        expert = torch.arange(experts).repeat_interleave(per)
        return Routing(token.reshape(-1), expert, weight.reshape(-1), scores)


@pytest.mark.parametrize("dispatch", list(spec.DISPATCHES))
def test_a_router_of_another_kind_runs_through_the_layer(dispatch: str) -> None:
    """Swap the layer's router for an expert-choice one: the dispatch takes its map, the
    layer's output is the hand sum over its copies, and with room for every copy the
    capacity dispatch equals the dropless one."""
    cfg = moe_cfg(moe_dispatch=dispatch, moe_balance="aux", moe_aux_coef=0.1)
    m = build(cfg, seed=7)
    router = ExpertChoiceRouter(cfg)
    router.load_state_dict(m.router.state_dict())
    m.router = router
    x = torch.randn(2, 6, cfg.dim, generator=torch.Generator().manual_seed(1))
    y, _ = m(x, None)
    tokens = x.reshape(-1, cfg.dim)
    route = router(tokens)
    counts = torch.bincount(route.token, minlength=route.tokens)
    assert counts.min() != counts.max()  # not a fixed number of copies per token
    payload = payload_of(m, tokens)
    every = m.experts(payload, None)  # [E, tokens, width]: every expert on every token
    by_hand = torch.zeros(route.tokens, every.shape[-1])
    for t, e, w in zip(route.token.tolist(), route.expert.tolist(), route.weight, strict=True):
        by_hand[t] += w * every[e, t]
    by_hand = by_hand + m.shared(payload, None).sum(0) if hasattr(m, "shared") else by_hand
    expected = m.down_proj.up(by_hand) if m.latent else by_hand
    assert rel(y.detach(), expected.detach().view(2, 6, -1)) < 2e-5
    y.sum().backward()  # the balance loss and the dispatch's backward take the map too
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().max() > 0
    room = with_capacity(payload, route, cfg.moe_experts, route.copies, m.experts)
    assert int(room[1]) == 0
    assert rel(room[0], dropless(payload, route, cfg.moe_experts, m.experts)) < 2e-5


def test_the_routing_map_imports_torch_only() -> None:
    """The map is the dispatch math's interface; like that math it must run without boostlr
    (an export can carry both beside its remote code)."""
    import ast

    from boostlr.models import moe_routing

    tree = ast.parse(open(moe_routing.__file__).read())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert imported <= {"__future__", "typing", "torch"}, imported
