"""The pluggable MLP: the gated MLP's roles, its unchanged parameter names, the arch spec
choosing each linear, and a strategy refusing an MLP kind it does not run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from boostlr.config import ModelConfig, build_config
from boostlr.models.llama import build_model
from boostlr.models.lowrank import DenseLinear, LaxLinear, LowRankLinear, make_linear
from boostlr.models.mlp import GATED, GatedMLP, gated, make_mlp
from boostlr.models.shapes import GATED_MLP, MLP_LINEARS, block_linear
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.strategies import SINGLE, runtime_for
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.specs.arch import ARCHS


def model_cfg(arch: str, **extra: str) -> ModelConfig:
    overrides = [("model.preset", "tiny"), ("model.arch", arch)]
    cfg = build_config(overrides=overrides + [(f"model.{k}", v) for k, v in extra.items()])
    cfg.model.vocab_size = 64
    return cfg.model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_gated_mlp_names_its_linears_by_role_under_llama_names(arch: str) -> None:
    cfg = model_cfg(arch)
    mlp = make_mlp(cfg, 1, "meta")
    assert isinstance(mlp, GatedMLP) and mlp.kind == GATED
    assert [name for name, _ in mlp.readers()] == ["gate_proj", "up_proj"]
    assert mlp.writer()[0] == "down_proj" and GATED_MLP.names == MLP_LINEARS
    assert [lin for _, lin in mlp.readers()] == [mlp.gate_proj, mlp.up_proj]
    assert mlp.writer()[1] is mlp.down_proj
    # The HF LLaMA names, whatever the linear: checkpoints and exports read them.
    names = {n for n, _ in build_model(cfg, device="meta").named_parameters()}
    for linear in MLP_LINEARS:
        assert any(n.startswith(f"layers.1.mlp.{linear}.") for n in names)
    assert all(block_linear(n) in MLP_LINEARS for n in names if ".mlp." in n)


@pytest.mark.parametrize(
    ("arch", "kind", "activation"),
    [("full", DenseLinear, None), ("cola", LowRankLinear, True), ("svd", LowRankLinear, False)],
)
def test_make_linear_builds_the_arch_specs_linear(arch, kind, activation) -> None:
    lin = make_linear(model_cfg(arch), 8, 16, 1, "meta")
    assert type(lin) is kind
    if activation is not None:
        assert lin.activation is activation
    lax = make_linear(model_cfg("lax"), 8, 16, 1, "meta")
    assert isinstance(lax, LaxLinear) and lax.cross.gate_kind == "factored"
    assert make_linear(model_cfg("lax"), 8, 16, 0, "meta").cross.gate_kind is None


def test_block_linear_knows_only_the_block_linears() -> None:
    assert block_linear("layers.3.mlp.up_proj.down.weight") == "up_proj"
    assert block_linear("layers.3.self_attn.o_proj.weight") == "o_proj"
    assert block_linear("layers.3.mlp.router.weight") is None
    assert block_linear("layers.3.input_layernorm.weight") is None
    assert block_linear("lm_head.weight") is None


class ToyMLP(nn.Module):
    """Another MLP kind over the gated MLP's linears (so placement knows the names)."""

    kind = "toy"

    def __init__(self, inner: GatedMLP):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            inner.gate_proj,
            inner.up_proj,
            inner.down_proj,
        )

    def forward(self, x, z_prev):
        g, _ = self.gate_proj(x)
        u, _ = self.up_proj(x)
        y, _ = self.down_proj(torch.relu(g) * u)
        return y, {}


def _toy_model(arch: str) -> nn.Module:
    model = build_model(model_cfg(arch), seed=1)
    for block in model.layers.values():
        block.mlp = ToyMLP(block.mlp)
    return model


@pytest.mark.parametrize(
    ("arch", "strategy"), [("full", "megatron"), ("cola", "btp"), ("cola", "vanilla")]
)
def test_a_strategy_refuses_an_mlp_kind_it_does_not_run(arch: str, strategy: str) -> None:
    model = _toy_model(arch)
    with pytest.raises(
        ValueError,
        match=rf"tp strategy '{strategy}' runs 'gated'.* MLPs, not the 'toy' MLP of layer 0",
    ):
        runtime_for(strategy, model)
    ctx = TPContext(GroupComm(None, "tp", CommLedger()), model.cfg)
    with pytest.raises(ValueError, match="'toy' MLP"):
        TensorParallelModel(model, strategy, ctx)
    with pytest.raises(ValueError, match=rf"tp strategy '{strategy}' runs only a 'gated' MLP"):
        gated(model.layers["0"].mlp, strategy)


def test_the_single_device_runtime_runs_any_mlp_kind() -> None:
    """BTP's grouped one-device block takes only the gated MLP; another kind gets the
    model's own math."""
    model = _toy_model("cola")
    assert runtime_for(None, model) is SINGLE
    ctx = TPContext(GroupComm(None, "tp", CommLedger()), model.cfg, grouping=True)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
        got = TensorParallelModel(model, None, ctx)(tokens)
    assert torch.equal(got, expected)
