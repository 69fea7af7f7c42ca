"""The strategy and arch specs agree with everything that states the same facts elsewhere:
the schema's sets, validation, the sharding table, the pipeline's boundaries, the design's
per-block traffic and the remote-code export."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from boostlr.config import (
    ACT_CKPT_MODES,
    ARCHS,
    LOWRANK_ARCHS,
    TP_STRATEGIES,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    resolve_model,
)
from boostlr.config.validate import validate_parallel
from boostlr.errors import ConfigError
from boostlr.models.placement import BLOCK_NORM, DOWN, EMBEDDING, RULES, UP
from boostlr.specs import arch as arch_specs
from boostlr.specs import strategy as strategy_specs
from boostlr.specs.arch import arch_spec
from boostlr.specs.strategy import STRATEGIES, BlockShape, default_strategy, strategy_spec

SPECS = Path(__file__).parents[1] / "src" / "boostlr" / "specs"


def test_the_schema_sets_are_the_specs() -> None:
    assert ARCHS == tuple(arch_specs.ARCHS)
    assert LOWRANK_ARCHS == ("cola", "svd", "lax")
    assert TP_STRATEGIES == ("auto", *STRATEGIES)
    for s in STRATEGIES.values():
        assert set(s.act_ckpt) <= set(ACT_CKPT_MODES)


def test_specs_import_nothing_else_from_boostlr() -> None:
    """The config package imports the specs: anything they import from boostlr is a circle."""
    for path in SPECS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("boostlr") or name.startswith("boostlr.specs"), (
                    path.name,
                    name,
                )


def _model(arch: str) -> ModelConfig:
    return resolve_model(ModelConfig(preset="tiny", arch=arch))


@pytest.mark.parametrize(
    ("arch", "strategy", "ckpt"),
    list(itertools.product(ARCHS, STRATEGIES, ACT_CKPT_MODES)),
)
def test_validation_takes_what_the_spec_takes(arch: str, strategy: str, ckpt: str) -> None:
    s, a = strategy_spec(strategy), arch_spec(arch)
    p = ParallelConfig(tp=2, tp_strategy=strategy, act_ckpt=ckpt)
    if s.takes(a) and ckpt in s.act_ckpt:
        validate_parallel(p, _model(arch))
    else:
        with pytest.raises(ConfigError):
            validate_parallel(p, _model(arch))


def test_auto_picks_the_default_strategy() -> None:
    for name, a in arch_specs.ARCHS.items():
        assert ParallelConfig(tp=2).strategy_for(name) == default_strategy(a).name
        assert default_strategy(a).takes(a)
        assert ParallelConfig(tp=1).strategy_for(name) is None


def test_the_sharding_table_follows_the_spec() -> None:
    """A sharded residual splits the norms' gains and the embedding along d; a split rank
    splits A's rows and B's columns; a replicated residual keeps the norms whole."""
    assert set(RULES) == {None, *STRATEGIES}
    for s in STRATEGIES.values():
        rules = RULES[s.name]
        assert rules[BLOCK_NORM] == (0 if s.residual_sharded else None)
        assert rules[EMBEDDING] == (1 if s.residual_sharded else 0)
        if s.takes_lowrank:
            assert (rules[DOWN], rules[UP]) == ((0, 1) if s.splits_rank else (1, 0))


def test_the_pipeline_boundary_is_the_residual_width_plus_crossing_latents() -> None:
    from boostlr.parallel.pipeline import boundary_shapes

    for arch, strategy in itertools.product(ARCHS, STRATEGIES):
        s, a = strategy_spec(strategy), arch_spec(arch)
        if not s.takes(a):
            continue
        cfg = RunConfig(model=_model(arch))
        cfg.parallel.tp, cfg.parallel.tp_strategy = 2, strategy
        shapes = boundary_shapes(cfg, 3, 2, layer=1)
        m = cfg.model
        assert shapes[0] == (3, cfg.data.seq_len, s.residual_width(m.dim, 2))
        assert len(shapes) == (8 if a.crossing else 1)
        assert all(sh == (3, cfg.data.seq_len, m.rank) for sh in shapes[1:])


def test_no_down_proj_latent_crosses_into_an_moe_block() -> None:
    """LaX MoE: an MoE block's B_d takes no crossing, so a boundary into one carries the
    residual and six latents; into a dense block (before ``moe_dense_layers``) all seven."""
    from boostlr.models.shapes import crossing_latents
    from boostlr.parallel.pipeline import boundary_shapes

    cfg = RunConfig(model=_model("lax"))
    cfg.model.moe_experts, cfg.model.moe_dense_layers = 4, 2
    assert "down_proj" in crossing_latents(cfg.model, 1)
    six = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
    assert crossing_latents(cfg.model, 2) == six
    assert len(boundary_shapes(cfg, 3, 1, layer=1)) == 8
    assert len(boundary_shapes(cfg, 3, 1, layer=2)) == 7
    cfg.model.arch = "cola"
    assert crossing_latents(cfg.model, 2) == ()


def test_block_traffic_is_the_designs() -> None:
    """docs/design.md §2 at LLaMA-7B shapes, r = d/4, bf16: per block forward megatron
    2·T·d, vanilla T·(3d + 2·d_kv + 2f), btp 7·T·r plus two fp32 [T, 1] statistics."""
    T, d, f, r, a = 4 * 4096, 4096, 11008, 1024, 2
    shape = BlockShape(T, d, d, f, r, a)
    sent = {n: s.block_traffic(shape, True, "online") for n, s in STRATEGIES.items()}
    assert sent["megatron"].fwd == 2 * T * d * a
    assert sent["vanilla"].fwd == T * (3 * d + 2 * d + 2 * f) * a
    assert sent["btp"].fwd == 7 * T * r * a + 2 * T * 4
    # ~5.9x less than vanilla and ~0.88x of megatron, as the design says
    assert round(sent["vanilla"].fwd / sent["btp"].fwd, 1) == 5.9
    assert round(sent["btp"].fwd / sent["megatron"].fwd, 2) == 0.88
    # Ungrouped BTP issues one collective per down-projection; sync norms two more.
    assert strategy_specs.BTP.block_traffic(shape, False, "sync").calls_fwd == 9
    crossing = BlockShape(T, d, d, f, r, a, crossing=True)
    assert sent["btp"] == strategy_specs.BTP.block_traffic(crossing, True, "online")
    extra = strategy_specs.VANILLA.block_traffic(crossing, True, "online").fwd - sent["vanilla"].fwd
    assert extra == 7 * T * r * a  # each split latent gathered whole for the crossing


def test_arch_facts() -> None:
    assert [n for n, a in arch_specs.ARCHS.items() if a.mergeable] == ["svd"]
    assert [n for n, a in arch_specs.ARCHS.items() if a.crossing] == ["lax"]
    lax = arch_specs.LAX_ARCH
    assert lax.passes(0) != lax.passes(1) and lax.kernels(0) != lax.kernels(1)
    assert arch_specs.COLA.passes(0) == arch_specs.COLA.passes(1)
    assert arch_specs.FULL.linear_params(8, 16, 0) == (128, 128)
    assert lax.linear_params(8, 16, 2, gate=4, layer=0) == (50, 48)  # no gate in block 0
    assert lax.linear_params(8, 16, 2, gate=4, layer=1) == (54, 52)
    assert arch_specs.is_lowrank("cola") and not arch_specs.is_lowrank("full")
    assert arch_specs.is_lowrank(None)  # a file without an arch: shown as low-rank


def test_strategies_draw_apart() -> None:
    looks = [(s.colour, s.line) for s in STRATEGIES.values()]
    assert len(set(looks)) == len(looks)


def test_the_remote_code_model_types_are_the_specs() -> None:
    pytest.importorskip("transformers")
    from boostlr.hf.configuration_boostlr import CONFIG_CLASSES

    lowrank = {n: a for n, a in arch_specs.ARCHS.items() if a.lowrank}
    assert set(CONFIG_CLASSES) == set(lowrank)
    for name, cls in CONFIG_CLASSES.items():
        assert cls.model_type == lowrank[name].hf_model_type
        assert cls.arch == name
