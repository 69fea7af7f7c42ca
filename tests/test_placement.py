"""The one table of sharding rules (``boostlr.models.placement``): complete, strict, torch-free,
and what the planner counts from it is what a sharded model holds."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from parallel_cases import layout_config
from torch.distributed.tensor import DTensor

from boostlr.analysis.memory import rank_params
from boostlr.config import RunConfig, build_config
from boostlr.config.schema import TPStrategy
from boostlr.errors import ConfigError
from boostlr.models.llama import LlamaModel
from boostlr.models.placement import KINDS, MOE, RULES, param_kind, shard_dim

SRC = Path(__file__).parents[1] / "src"
ARCHS = ("full", "svd", "cola", "lax")
# Every strategy a config can name, and the single-device model (``None``).
STRATEGIES = [None, *(s for s in typing.get_args(TPStrategy) if s != "auto")]


def _config(arch: str, strategy: str | None, **extra: str) -> RunConfig | None:
    """A tiny tp2 config of ``arch`` under ``strategy``; ``None`` where the config refuses it."""
    overrides = {
        "model.preset": "tiny",
        "model.arch": arch,
        "parallel.tp": "1" if strategy is None else "2",
        "parallel.tp_strategy": strategy or "auto",
        **extra,
    }
    try:
        cfg = build_config(overrides=list(overrides.items()))
    except ConfigError:
        return None
    cfg.model.vocab_size = 101
    return cfg


def _names(cfg: RunConfig) -> list[str]:
    model = LlamaModel(cfg.model, device="meta")
    return [n for n, _ in model.named_parameters(remove_duplicate=False)]


def test_the_table_covers_every_strategy_the_config_accepts() -> None:
    assert set(RULES) == set(STRATEGIES)
    assert RULES[None] == dict.fromkeys(KINDS)  # one device: every kind listed, all whole


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_of_every_arch_has_a_rule_under_every_strategy(arch: str) -> None:
    variants = [{}, {"model.lax_gate": "full"}] if arch == "lax" else [{}]
    accepted = set()
    for strategy in STRATEGIES:
        for extra in variants:
            cfg = _config(arch, strategy, **extra)
            if cfg is None:  # refused by the config: the table has no rules for it either
                names = _names(_config(arch, None, **extra))
                with pytest.raises(ValueError, match=str(strategy)):
                    for name in names:
                        shard_dim(name, strategy)
                continue
            accepted.add(strategy)
            model = LlamaModel(cfg.model, device="meta")
            for name, p in model.named_parameters(remove_duplicate=False):
                dim = shard_dim(name, cfg.parallel.strategy_for(arch))
                assert dim is None or dim < p.dim(), (arch, strategy, name, dim)
    assert accepted == ({None, "megatron"} if arch == "full" else {None, "vanilla", "btp"})


def test_every_kind_is_some_parameter() -> None:
    """No dead rows: each kind of the table names parameters of some arch."""
    seen = set()
    moe = {"model.moe_experts": "4", "model.moe_ffn_dim": "16"}  # the MoE kind
    for arch in ARCHS:
        for extra in ({}, {"model.lax_gate": "full"}, moe):
            seen |= {param_kind(n) for n in _names(_config(arch, None, **extra))}
    assert seen == set(KINDS)


def test_moe_parameters_have_rules_only_on_the_single_device_model_and_btp() -> None:
    """MoE runs at tp 1 and under BTP (router and experts whole): every other strategy's
    table lacks the kind, so a build under one fails loudly (the config refuses it first,
    in one line)."""
    moe = {"model.moe_experts": "4", "model.moe_ffn_dim": "16"}
    names = _names(_config("cola", None, **moe))
    assert {param_kind(n) for n in names if ".router." in n or ".experts." in n} == {MOE}
    assert all(shard_dim(n, None) is None for n in names)
    assert shard_dim("layers.0.mlp.router.weight", "btp") is None
    for strategy in [s for s in STRATEGIES[1:] if s != "btp"]:
        assert _config("cola", strategy, **moe) is None
        with pytest.raises(ValueError, match="MoE router or expert"):
            shard_dim("layers.0.mlp.router.weight", strategy)


@pytest.mark.parametrize(
    "name",
    [
        "layers.0.self_attn.q_proj.A.weight",  # lowrank.py's down renamed
        "layers.0.mlp.down_proj.B.weight",  # ... its up renamed
        "layers.0.self_attn.q_proj.cross.ln.weight",
        "layers.0.mlp.q_proj.down.weight",  # a linear under the wrong holder
        "layers.0.self_attn.qkv_proj.weight",
        "layers.0.input_layernorm.bias",
        "layers.x.input_layernorm.weight",
        "layers.0.self_attn.q_proj",
        "embed_tokens.weight.extra",
        "final_norm.weight",
    ],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_unknown_parameter_is_an_error_naming_it_and_the_strategy(
    name: str, strategy: str | None
) -> None:
    with pytest.raises(ValueError) as err:
        shard_dim(name, strategy)
    message = str(err.value)
    assert repr(name) in message and repr(strategy or "single-device") in message, message


def test_a_kind_outside_the_strategys_rules_and_an_unknown_strategy_are_errors() -> None:
    with pytest.raises(ValueError, match="'megatron'"):
        shard_dim("layers.1.mlp.up_proj.down.weight", "megatron")
    with pytest.raises(ValueError, match="'btp'"):
        shard_dim("layers.1.self_attn.q_proj.weight", "btp")
    with pytest.raises(ValueError, match="'auto'"):
        shard_dim("norm.weight", "auto")


def test_norm_gains_and_lax_crossings_are_listed_replicated_where_they_are() -> None:
    for strategy in ("megatron", "vanilla"):
        assert shard_dim("norm.weight", strategy) is None
        assert shard_dim("layers.3.post_attention_layernorm.weight", strategy) is None
    assert shard_dim("layers.3.input_layernorm.weight", "btp") == 0  # follows the d-slice
    for strategy in ("vanilla", "btp"):
        assert shard_dim("layers.1.mlp.gate_proj.cross.norm.weight", strategy) is None
        assert shard_dim("layers.1.mlp.gate_proj.cross.gate_up.weight", strategy) is None


def test_the_rules_module_imports_no_torch() -> None:
    """Planning reads these rules for 40B models on machines without torch's cost."""
    code = (
        "import sys, boostlr.models.placement\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


# --- the plan's parameters against a real sharded model --------------------------------------

TP2 = [
    ("full", "megatron", {}),
    ("full", "megatron", {"model.tie_embeddings": "true"}),
    ("svd", "btp", {}),
    ("cola", "btp", {}),
    ("cola", "vanilla", {}),
    ("lax", "btp", {"model.lax_gate": "full"}),
    ("lax", "vanilla", {}),
]


def _local_bytes(rank: int, world: int, cases: list[tuple[str, RunConfig]]) -> dict:
    """This rank's parameter bytes (each tensor once) per case, and its tp rank."""
    from boostlr.parallel.engine import ParallelModel

    out = {}
    for label, cfg in cases:
        model = ParallelModel.build(cfg, torch.device("cpu"))
        held = 0
        for p in model.parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            held += t.numel() * t.element_size()
        out[label] = (model.comms.tp.rank, held)
    return out


def test_the_plans_parameter_bytes_at_tp2_are_the_sharded_models() -> None:
    """Exactly, on both tp ranks: the tiny model's vocabulary (101) splits unevenly."""
    cases = [
        (f"{arch} {strategy} {extra}", layout_config(arch, strategy, 1, 1, 2, **extra))
        for arch, strategy, extra in TP2
    ]
    per_rank = run_distributed(_local_bytes, 2, cases, timeout_s=300)
    configs = dict(cases)
    tp_ranks = set()
    for reports in per_rank:
        for label, (tp_rank, held) in reports.items():
            cfg = configs[label]
            strategy = cfg.parallel.strategy_for(cfg.model.arch)
            planned = 4 * rank_params(cfg.model, strategy, cfg.parallel, 0, tp_rank).local
            assert planned == held, (label, tp_rank, planned, held)
            tp_ranks.add(tp_rank)
    assert tp_ranks == {0, 1}
