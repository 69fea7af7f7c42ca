"""Tied embeddings under BTP on real gloo ranks: the one table, split along the vocabulary
as the head, gives the single device's loss and every gradient (fp32), and the ledger's
bytes equal the plan's (the embedding's reduce-scatter included); a pipeline with a tied
table is refused in one line (issue 47, item 3)."""

from __future__ import annotations

import copy

import pytest
from distributed import run_distributed
from test_tensor_parallel import TIED_BTP_CASES, assert_reports, check_case, run_config
from tp_reference import CPU

from boostlr.config import build_config
from boostlr.errors import ConfigError
from boostlr.parallel.mesh import build_mesh


def _run(rank: int, world_size: int) -> list[dict]:
    kv = 2 if world_size == 2 else 4  # GQA where the degree allows it
    cases = [{**copy.deepcopy(c), "n_kv_heads": kv, "curve": False} for c in TIED_BTP_CASES]
    comms = build_mesh(run_config(cases[0], world_size).parallel, CPU)
    return [check_case(case, comms) for case in cases]


def test_tied_btp_matches_single_device_at_tp2() -> None:
    per_rank = run_distributed(_run, 2, timeout_s=600)
    for reports in per_rank:
        assert_reports(reports)
        for r in reports:  # the lookup's reduce-scatter and its gradient's all-gather
            assert r["ledger"]["comm_tp_bytes_fwd"] > 0


def test_tied_embeddings_under_a_pipeline_are_refused_in_one_line() -> None:
    over = [("model.preset", "tiny"), ("model.tie_embeddings", "true"), ("parallel.pp", "2")]
    with pytest.raises(ConfigError, match="tie_embeddings.*pipeline stages"):
        build_config(overrides=[*over, ("parallel.tp", "2"), ("parallel.tp_strategy", "btp")])


def test_the_plan_counts_one_copy_of_a_tied_table_under_btp() -> None:
    """At tp 2 a tied rank holds the head's [V/2, d] rows once; untied, it also holds the
    embedding's [V, d/2] d-slice."""
    from boostlr.analysis.memory import rank_params

    def local(tie: str) -> int:
        over = [("model.preset", "tiny"), ("model.arch", "cola"), ("model.vocab_size", "100")]
        over += [("model.tie_embeddings", tie), ("parallel.tp", "2")]
        cfg = build_config(overrides=[*over, ("parallel.tp_strategy", "btp")])
        return rank_params(cfg.model, "btp", cfg.parallel, 0).local

    cfg = build_config(overrides=[("model.preset", "tiny")])
    assert local("false") - local("true") == 100 * cfg.model.dim // 2
