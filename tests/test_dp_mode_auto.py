"""``parallel.dp_mode auto``: resharded without a pipeline; under one, the plan's choice.

How the choice is resolved and shown, that the saved config carries it, each mode's floor,
and that the plan's dp traffic is the chosen mode's (the real runs behind both pipeline
modes: ``tests/test_plan_trace.py``'s pp2 x dp2 x tp2 layouts, the default and ``fsdp``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_train import tiny_run_config

from boostlr.analysis.comm import fsdp_bytes, fsdp_pipeline_bytes
from boostlr.analysis.costmodel import comm_metrics, planning_config, vocab_step_bytes
from boostlr.analysis.dp_choice import (
    MEMORY_MARGIN,
    choose_dp_mode,
    mode_held_bytes,
    planned_peak,
    with_mode,
)
from boostlr.analysis.hardware import load_profile
from boostlr.analysis.memory import rank_params
from boostlr.config import ParallelConfig, build_config, dump_toml, resolve
from boostlr.errors import ConfigError
from boostlr.train import dp_mode
from boostlr.train import run as trainer
from boostlr.train.dp_mode import PlanRule
from boostlr.train.summary import startup_lines

VOCAB = SimpleNamespace(vocab_size=256)


def _cfg(pp: int, dp: int, *extra: tuple[str, str]):
    over = [
        ("model.preset", "1B"),
        ("data.seq_len", "1024"),
        ("train.batch_size", "4"),
        ("parallel.tp", "2"),
        ("parallel.pp", str(pp)),
        ("parallel.dp", str(dp)),
        *extra,
    ]
    return build_config(overrides=over)


def _small(*extra: tuple[str, str]):
    """A model whose parameters count by hand: 8 full blocks of d 64 (4 heads of 16, ffn
    128), an untied 256-row vocabulary held by FSDP, pp 2 x dp 2, fp32."""
    over = [
        ("model.preset", "tiny"),
        ("model.arch", "full"),
        ("model.dim", "64"),
        ("model.n_layers", "8"),
        ("model.n_heads", "4"),
        ("model.n_kv_heads", "4"),
        ("model.ffn_dim", "128"),
        ("model.vocab_size", "256"),
        ("model.tie_embeddings", "false"),
        ("data.seq_len", "32"),
        ("train.batch_size", "2"),
        ("parallel.pp", "2"),
        ("parallel.dp", "2"),
        ("parallel.vocab_dp", "false"),
        *extra,
    ]
    return build_config(overrides=over)


@pytest.mark.parametrize(("pp", "mode"), [(1, "fsdp"), (2, "ddp"), (4, "ddp")])
def test_auto_resolves_by_the_pipeline_without_a_device(pp: int, mode: str) -> None:
    cfg = _cfg(pp, 2)
    # Without a pipeline the layout decides in place; under one it waits for the plan.
    assert cfg.parallel.dp_mode == ("fsdp" if pp == 1 else "auto")
    assert cfg.parallel.data_parallel_mode == mode
    assert ParallelConfig(pp=pp, dp=2).data_parallel_mode == mode  # unresolved: the same
    resolved = resolve(cfg, VOCAB)  # no rule (a test's build): the layout's default
    assert f'dp_mode = "{mode}"' in dump_toml(resolved)


def test_explicit_modes_stay_and_nonsense_is_one_line() -> None:
    for pp in (1, 2):
        for mode in ("fsdp", "ddp"):
            cfg = _cfg(pp, 2, ("parallel.dp_mode", mode))
            assert cfg.parallel.dp_mode == mode
            never = resolve(cfg, VOCAB, lambda c: pytest.fail("an explicit mode is asked"))
            assert never.parallel.dp_mode == mode
    with pytest.raises(ConfigError, match=r"^parallel.dp_mode 'zero' is not one of: auto, "):
        _cfg(2, 2, ("parallel.dp_mode", "zero"))


def test_ddp_holds_the_gathered_stage_and_its_gradients_by_hand() -> None:
    # pp rank 0: blocks 0-3 (each q, k, v, o: 4 x 64 x 64; gate, up, down: 3 x 64 x 128;
    # two norms of 64: 41,088) and the embedding (256 x 64): 180,736 elements, gathered in
    # fp32 with fp32 unreduced gradients under the pipeline: 8 bytes each, 1,445,888.
    block = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert mode_held_bytes(_small(), 0) == {"fsdp": 0.0, "ddp": 1_445_888.0}
    assert 8 * (4 * block + 256 * 64) == 1_445_888
    # bf16: the gather is in bf16 (2 bytes), the gradients stay fp32.
    bf16 = mode_held_bytes(_small(("train.dtype", "bfloat16")), 0)
    assert bf16["ddp"] == 6.0 * (4 * block + 256 * 64)
    # No pipeline: the stage is gathered forward to backward, gradients reduce as they come.
    flat = mode_held_bytes(_small(("parallel.pp", "1")), 0)
    assert flat["ddp"] == 4.0 * (8 * block + 2 * 256 * 64 + 64)  # blocks, vocab, final norm


def test_the_plan_takes_ddp_only_where_it_fits_with_the_margin(tmp_path: Path) -> None:
    cfg = _small()
    peak = {m: planned_peak(with_mode(cfg, m), None) for m in ("fsdp", "ddp")}
    assert peak["ddp"] > peak["fsdp"]  # 4 blocks a stage, gathered, against fsdp's 2
    fits = peak["ddp"] / (1 - MEMORY_MARGIN)  # the least memory that leaves the margin free
    rule = {
        "fits": lambda c: choose_dp_mode(c, fits, None, "test").mode,
        "short": lambda c: choose_dp_mode(c, 0.999 * fits, None, "test").mode,
    }
    chosen = resolve(cfg, VOCAB, rule["fits"])
    assert chosen.parallel.dp_mode == "ddp"  # fewer dp bytes, and it fits
    assert 'dp_mode = "ddp"' in dump_toml(chosen)  # the saved config carries the decision
    short = resolve(cfg, VOCAB, rule["short"])
    assert short.parallel.dp_mode == "fsdp"
    assert 'dp_mode = "fsdp"' in dump_toml(short)
    # A resumed run reads its saved config: the mode stays, whatever the device says now.
    (tmp_path / "config.toml").write_text(dump_toml(short))
    again = build_config(tmp_path / "config.toml", saved=True)
    assert resolve(again, VOCAB, rule["fits"]).parallel.dp_mode == "fsdp"
    # The reasons name the figures; both modes ranked by dp bytes without a profile.
    why = choose_dp_mode(planning_config(cfg), 0.999 * fits, None, "test")
    assert why.line().startswith("parallel.dp_mode auto -> fsdp: the plan's ddp peak ")
    assert "85% of" in why.line() and why.speed["ddp"] < why.speed["fsdp"]


def test_the_start_line_says_which_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _small()
    rule = PlanRule(torch.device("cpu"))
    resolved = resolve(cfg, VOCAB, rule)
    assert rule.choice is not None and rule.choice.mode == resolved.parallel.dp_mode
    assert "the host's memory over 4 local ranks" in rule.choice.memory_source
    lines = startup_lines(resolved, tmp_path, tmp_path, torch.device("cpu"), False, rule.lines())
    assert lines[1] == rule.choice.line()
    # A profile that cannot time the run (no bf16 peak): the modes ranked by dp bytes.
    hw = load_profile("h100-sxm")
    fp32_only = dataclasses.replace(hw, peak_flops={"float32": hw.peak_flops["float32"]})
    monkeypatch.setattr(dp_mode, "device_memory", lambda d, w: (hw.memory, fp32_only, "test"))
    bf16 = PlanRule(torch.device("cpu"))
    assert resolve(_small(("train.dtype", "bfloat16")), VOCAB, bf16).parallel.dp_mode == "ddp"
    assert bf16.choice is not None and " dp bytes a step vs fsdp's " in bf16.choice.reason
    none = PlanRule(torch.device("cpu"))  # pp 1: the layout decided, nothing to say
    resolve(_small(("parallel.pp", "1")), VOCAB, none)
    assert none.lines() == []


def test_a_pipeline_run_prints_the_choice_saves_it_and_logs_each_floor(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    over = {"parallel.pp": 2, "parallel.dp": 2, "model.n_layers": 2, "train.steps": 1}
    cfg = tiny_run_config(small_dataset, **over, **{"train.eval_every": 9, "train.ckpt_every": 9})
    assert cfg.parallel.dp_mode == "auto"
    trainer.train(cfg, run, console=True)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("parallel.dp_mode auto -> "))
    mode = line.split()[3].rstrip(":")
    assert build_config(run / "config.toml", saved=True).parallel.dp_mode == mode
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    assert row["mem_floor_fsdp_mb"] == row["mem_floor_mb"]  # fsdp holds only its shards
    assert row["mem_floor_ddp_mb"] > row["mem_floor_mb"]


@pytest.mark.parametrize("mode", ["auto", "fsdp", "ddp"])
def test_the_plans_dp_bytes_follow_the_mode(mode: str) -> None:
    cfg = planning_config(_cfg(2, 2, ("parallel.dp_mode", mode)))
    p, m = cfg.parallel, cfg.model
    reshard = mode == "fsdp"  # an unresolved auto plans the layout's default: ddp
    for pp_rank in (0, 1):
        params = rank_params(m, p.strategy_for(m.arch), p, pp_rank)
        expected = fsdp_pipeline_bytes(
            list(params.modules), p.dp, cfg.train.grad_accum, reshard, p.pp_microbatches, 4
        )
        expected += vocab_step_bytes(cfg, pp_rank)
        assert comm_metrics(cfg, pp_rank)["comm_dp_bytes"] == expected
    # Without a pipeline auto is fsdp: a gather in forward and backward, one reduction.
    flat = planning_config(_cfg(1, 2))
    params = rank_params(flat.model, "btp", flat.parallel, 0)
    expected = fsdp_bytes(list(params.modules), 2, flat.train.grad_accum, True, 4)
    assert comm_metrics(flat)["comm_dp_bytes"] == expected + vocab_step_bytes(flat)


def test_plan_rows_take_the_trainers_choice_on_the_profiles_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from boostlr.analysis.costmodel import predict
    from boostlr.analysis.dp_choice import MODES
    from boostlr.analysis.plan import families, strategy_rows, variant
    from boostlr.cli.plan import print_dp_auto

    cfg = _cfg(2, 2)  # tp 2 x pp 2 x dp 2, dp_mode left to auto
    hw = load_profile("a100-80gb")
    # A card too small to keep any stage gathered: every row is fsdp, whatever ddp's speed
    # (the layout's default, which the rows showed before, is ddp).
    small = dataclasses.replace(hw, memory=float(1 << 20))
    for row in strategy_rows(cfg, small):
        assert row.layout["dp_mode"] == "fsdp", row.arch
        assert "is over" in row.layout["dp_mode_auto"]
    # A card that holds both: each row runs the mode its own prediction has faster.
    huge = dataclasses.replace(hw, memory=float(1 << 50))
    rows = strategy_rows(cfg, huge)
    for row, (arch, strategy) in zip(rows, families(cfg), strict=True):
        same = variant(cfg, arch, strategy, row.layout["act_ckpt"])
        times = {m: predict(with_mode(same, m), huge).step_time for m in MODES}
        assert row.layout["dp_mode"] == min(times, key=times.__getitem__), (arch, times)
        assert row.step_time == times[row.layout["dp_mode"]]
    print_dp_auto(rows)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == len(rows) and all(x.startswith("parallel.dp_mode auto -> ") for x in said)
    # An explicit mode is the row's, with nothing to explain.
    fixed = strategy_rows(_cfg(2, 2, ("parallel.dp_mode", "ddp")), small)
    assert all(r.layout["dp_mode"] == "ddp" and "dp_mode_auto" not in r.layout for r in fixed)


def test_moe_plan_rows_decide_auto_and_name_their_dispatch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from boostlr.analysis.plan import strategy_rows
    from boostlr.cli.plan import print_dp_auto

    moe = [("model.moe_experts", "4"), ("model.moe_top_k", "2"), ("model.moe_ffn_dim", "1024")]
    cfg = _cfg(2, 2, *moe, ("parallel.tp", "1"))  # pp 2 x dp 2, every dispatch form a row
    small = dataclasses.replace(load_profile("a100-80gb"), memory=float(1 << 20))
    rows = strategy_rows(cfg, small)
    assert {r.moe["dispatch"] for r in rows} == {"hidden", "latent"}
    for row in rows:
        assert row.layout["dp_mode"] == "fsdp" and "is over" in row.layout["dp_mode_auto"]
    print_dp_auto(rows)
    said = capsys.readouterr().out.splitlines()
    assert [x.split("(")[1].split(")")[0] for x in said] == [
        f"{r.arch} {r.moe['dispatch']} dispatch" for r in rows
    ]
