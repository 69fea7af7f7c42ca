"""``parallel.vocab_dp auto``: the vocabulary split over dp unless ``dp x T > 1.5 x V / tp``.

The rule at both sides of its boundary, where it is resolved (config, trainer, plan), what
``boostlr plan`` shows and searches, and a real dp 2 run under ``auto`` against the explicit
choice it resolves to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import tiny_run_config

from boostlr.analysis import plan
from boostlr.analysis.costmodel import planning_config
from boostlr.analysis.hardware import load_profile
from boostlr.config import (
    build_config,
    dump_toml,
    from_dict,
    resolve,
    vocab_dp_rule,
    vocab_over_dp,
)
from boostlr.data.loader import TokenDataset
from boostlr.errors import ConfigError
from boostlr.train import run as trainer


def _cfg(dp: int, tp: int, seq: int, batch: int, pp: int = 1, micro: int = 0, vocab="32000"):
    over = {
        "model.preset": "7B",
        "model.vocab_size": vocab,
        "data.seq_len": seq,
        "train.batch_size": batch,
        "parallel.tp": tp,
        "parallel.dp": dp,
        "parallel.pp": pp,
        "parallel.microbatches": micro,
    }
    return build_config(overrides=[(k, str(v)) for k, v in over.items()])


@pytest.mark.parametrize(
    ("dp", "tp", "seq", "batch", "pp", "micro", "split"),
    [
        # V = 32000, tp 4: the boundary is dp x T = 12000 tokens.
        (3, 4, 4000, 1, 1, 0, True),  # 12000: at the boundary the split stays
        (3, 4, 4001, 1, 1, 0, False),  # 12003: past it
        (2, 4, 4096, 1, 1, 0, True),  # BOOST's micro-batch at dp 2: 8192
        (4, 4, 4096, 1, 1, 0, False),  # ... at dp 4: 16384
        (1, 4, 4096, 8, 1, 0, False),  # dp 1: the rule alone (nothing to split over anyway)
        # Under a pipeline T is one pipeline micro-batch: 8 sequences in 8 micro-batches.
        (2, 4, 4096, 8, 2, 8, True),  # 2 x 4096 = 8192
        (4, 4, 4096, 8, 2, 8, False),  # 4 x 4096 = 16384
        (3, 4, 4000, 2, 2, 2, True),  # 3 x 4000 = 12000
        (3, 4, 4001, 2, 2, 2, False),
    ],
)
def test_the_rule_at_both_sides_of_its_boundary(dp, tp, seq, batch, pp, micro, split) -> None:
    cfg = _cfg(dp, tp, seq, batch, pp, micro)
    assert cfg.parallel.vocab_dp is split  # resolved in place, a bool
    assert vocab_dp_rule(cfg) is split


def test_true_and_false_stay_as_given_and_nonsense_is_one_line() -> None:
    for value, expected in (("true", True), ("false", False), ("off", False), ("1", True)):
        cfg = build_config(overrides=[("parallel.vocab_dp", value), ("model.vocab_size", "32000")])
        assert cfg.parallel.vocab_dp is expected
    with pytest.raises(ConfigError, match=r"^parallel.vocab_dp: expected bool or 'auto'"):
        build_config(overrides=[("parallel.vocab_dp", "sometimes")])


def test_a_toml_file_takes_true_false_and_auto(tmp_path: Path) -> None:
    for text, expected in (("true", True), ("false", False), ('"auto"', False)):
        path = tmp_path / "c.toml"
        path.write_text(
            f"[model]\nvocab_size = 32000\n[data]\nseq_len = 4096\n"
            f"[parallel]\ndp = 4\ntp = 4\nnproc = 16\nvocab_dp = {text}\n"
        )
        cfg = build_config(path, [("train.batch_size", "1")])
        assert cfg.parallel.vocab_dp is expected
        assert from_dict(json.loads(json.dumps({"parallel": {"vocab_dp": expected}})))


def test_unknown_vocabulary_waits_and_the_trainer_and_planner_resolve_it(
    small_dataset: Path,
) -> None:
    # The vocabulary comes from the data: auto stays auto until the tokenizer is read.
    cfg = tiny_run_config(small_dataset, **{"parallel.dp": 2, "data.seq_len": 128})
    assert cfg.parallel.vocab_dp == "auto"
    assert "vocab_dp" in dump_toml(cfg)
    cfg = resolve(cfg, TokenDataset(small_dataset, "train"))
    v = cfg.model.vocab_size
    assert 2 * 4 * 128 > 1.5 * v and cfg.parallel.vocab_dp is False
    short = tiny_run_config(small_dataset, **{"parallel.dp": 2})  # 2 x 4 x 32 < 1.5 V
    short = resolve(short, TokenDataset(small_dataset, "train"))
    assert short.parallel.vocab_dp is True
    # The planner takes the preset's vocabulary, then resolves (a copy: cfg is not written).
    planned = build_config(overrides=[("model.preset", "7B"), ("parallel.dp", "4")])
    assert planned.parallel.vocab_dp == "auto"
    resolved = planning_config(planned)
    assert resolved.parallel.vocab_dp is vocab_over_dp(resolved)
    assert planned.parallel.vocab_dp == "auto"


def test_plan_shows_the_resolved_choice_and_search_tries_both() -> None:
    hw = load_profile("a100-80gb")
    seq = [("data.seq_len", "4096"), ("train.batch_size", "1"), ("parallel.tp", "4")]
    seq.append(("parallel.dp", "-1"))
    for gpus, split in ((8, True), (16, False)):  # dp 2: 8192 tokens; dp 4: 16384 > 12000
        cfg = plan.load_config(None, [("model.preset", "7B"), *seq], gpus, False)
        rows = plan.strategy_rows(cfg, hw)
        assert all(r.layout["vocab_dp"] is split for r in rows)
        assert all(r.row()["layout"]["vocab_dp"] is split for r in rows)
    cfg = plan.load_config(None, [("model.preset", "1B"), ("data.seq_len", "1024")], 8, True)
    found, _ = plan.candidates(cfg, hw, 8)
    tried = {
        (c.overrides["parallel.vocab_dp"], c.prediction.layout["vocab_dp"])
        for c in found
        if c.prediction.layout["dp"] > 1
    }
    assert tried == {("true", True), ("false", False)}


@pytest.mark.slow
def test_a_dp2_run_under_auto_equals_the_explicit_choice(
    small_dataset: Path, tmp_path: Path
) -> None:
    """seq 128 at dp 2: 2 x 4 x 128 tokens > 1.5 x V (the 512-token BPE): auto is false."""
    base = {"parallel.dp": 2, "data.seq_len": 128, "train.steps": 2, "train.eval_every": 2}
    auto, explicit = tmp_path / "auto", tmp_path / "explicit"
    trainer.train(tiny_run_config(small_dataset, **base), auto, console=False)
    off = {**base, "parallel.vocab_dp": "false"}
    trainer.train(tiny_run_config(small_dataset, **off), explicit, console=False)
    saved = build_config(auto / "config.toml", saved=True)
    assert saved.parallel.vocab_dp is False  # the run's config shows what auto decided
    assert "vocab_dp = false" in (auto / "config.toml").read_text()

    def rows(run: Path) -> list[dict]:
        out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        keys = ("step", "loss", "val_loss", "grad_norm", "comm_dp_bytes")
        return [{k: r[k] for k in keys if k in r} for r in out]

    assert rows(auto) == rows(explicit)
