"""The MoE config keys: saved only when set, one-line errors, and each MoE parameter's init rule."""

from __future__ import annotations

import pytest
from test_moe_model import moe_cfg

from boostlr.config import (
    ModelConfig,
    ParallelConfig,
    RunConfig,
    dump_toml,
    from_dict,
    resolve_model,
    to_dict,
)
from boostlr.config.schema import OMITTED_AT_DEFAULT
from boostlr.config.validate_moe import moe_dispatch_of, validate_moe
from boostlr.errors import ConfigError
from boostlr.models.llama import build_model
from boostlr.models.lowrank import cola_std
from boostlr.models.moe import make_moe_mlp
from boostlr.models.moe_experts import moe_init_rule


def test_dense_default_is_unchanged() -> None:
    dense = resolve_model(ModelConfig(preset="tiny", vocab_size=64))
    assert all(make_moe_mlp(dense, i) is None for i in range(dense.n_layers))
    keys = list(build_model(dense).state_dict())
    assert not any("router" in k or "experts" in k for k in keys)
    assert keys[:3] == ["embed_tokens.weight", "layers.0.input_layernorm.weight",
                        "layers.0.self_attn.q_proj.down.weight"]  # fmt: skip
    saved = to_dict(RunConfig())
    assert not set(OMITTED_AT_DEFAULT["model"]) & set(saved["model"])
    assert "moe" not in dump_toml(RunConfig())
    moe = RunConfig()
    moe.model.moe_experts, moe.model.moe_ffn_dim = 4, 32
    saved = to_dict(moe)["model"]
    assert saved["moe_experts"] == 4 and saved["moe_ffn_dim"] == 32
    assert "moe_top_k" not in saved  # still at its default
    assert from_dict(to_dict(moe)).model == moe.model


def test_first_layers_stay_dense() -> None:
    cfg = moe_cfg(n_layers=4, moe_dense_layers=2)
    assert [make_moe_mlp(cfg, i) is None for i in range(4)] == [True, True, False, False]


@pytest.mark.parametrize(
    ("kw", "layout", "message"),
    [
        (dict(moe_top_k=5), {}, "moe_top_k 5 must be in [1, model.moe_experts = 4]"),
        (dict(moe_ffn_dim=None), {}, "model.moe_ffn_dim is missing"),
        (dict(moe_dense_layers=2), {}, "model.moe_dense_layers 2 must be in [0"),
        (dict(arch="full", moe_dispatch="latent"), {}, "latent needs a low-rank arch"),
        (dict(arch="lax", moe_dispatch="hidden"), {}, "hidden is not supported for arch lax"),
        (dict(moe_experts=-1), {}, "model.moe_experts must be >= 0"),
        (dict(moe_experts=0, moe_top_k=3), {}, "model.moe_top_k is set but model.moe_experts"),
        (dict(moe_capacity=-1.0), {}, "model.moe_capacity must be >= 0"),
        (dict(moe_balance="loss"), {}, "model.moe_balance 'loss' is not one of: bias, aux"),
        (dict(rank=12), {}, "model.rank 12 exceeds model.moe_ffn_dim 8"),
        ({}, dict(tp=2, tp_strategy="vanilla"), "runs under tp strategy btp only"),
        (dict(moe_dispatch="hidden"), dict(tp=2), "moe_dispatch hidden runs on the single"),
        (dict(moe_capacity=1.0), dict(tp=2), "moe_capacity (1.0) is not supported with"),
    ],
)
def test_bad_moe_configs_are_one_line(kw: dict, layout: dict, message: str) -> None:
    base = dict(
        preset="tiny", dim=16, n_heads=2, ffn_dim=32, n_layers=2, rank=4,
        moe_experts=4, moe_top_k=2, moe_ffn_dim=8,
    )  # fmt: skip
    cfg = resolve_model(ModelConfig(**{**base, **kw}))
    with pytest.raises(ConfigError) as err:
        validate_moe(cfg, ParallelConfig(**layout))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_dispatch_auto_and_good_layouts() -> None:
    assert moe_dispatch_of(moe_cfg(arch="cola")) == "latent"
    assert moe_dispatch_of(moe_cfg(arch="lax")) == "latent"
    assert moe_dispatch_of(moe_cfg(arch="full", mlp="swiglu")) == "hidden"
    validate_moe(moe_cfg(), ParallelConfig(dp=4))
    validate_moe(moe_cfg(), ParallelConfig(pp=2, dp=4, ep=2))  # a pipeline of MoE stages
    validate_moe(moe_cfg(), ParallelConfig(tp=2, dp=2))  # BTP, latent dispatch
    validate_moe(moe_cfg(), ParallelConfig(pp=2, tp=2, dp=2, ep=2))  # ep x tp under BTP


@pytest.mark.parametrize("dispatch", ["latent", "hidden"])
def test_init_rules_cover_every_moe_parameter(dispatch: str) -> None:
    cfg = moe_cfg(arch="lax" if dispatch == "latent" else "cola", moe_dispatch=dispatch)
    cfg.moe_shared = 1
    m = make_moe_mlp(cfg, 1)
    for name, _ in m.named_parameters():
        rule = moe_init_rule(cfg, f"layers.1.mlp.{name}")
        assert (rule is None) == (".cross." in f".{name}"), name
    d, f, r = cfg.dim, cfg.moe_ffn_dim, cfg.rank
    assert moe_init_rule(cfg, "layers.1.mlp.router.weight") == cfg.init_std
    assert moe_init_rule(cfg, "layers.1.mlp.experts.down_proj.up.weight") == cola_std(f, d, r)
    assert moe_init_rule(cfg, "layers.1.mlp.experts.gate_proj.down.weight") == cola_std(d, f, r)
    cfg.moe_dense_layers = 1  # block 0 keeps the dense MLP and its rules
    assert moe_init_rule(cfg, "layers.0.mlp.gate_proj.down.weight") is None
    assert moe_init_rule(cfg, "layers.1.mlp.gate_proj.down.weight") == cola_std(d, f, r)
