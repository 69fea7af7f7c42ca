"""``benchmarks/gpu_suite.py`` without a GPU: the GEMM shapes it times and a tiny dry run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_suite.py"


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(SCRIPT.parent))  # as when run as a script: benchmarks/common.py
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["1B", "7B", "30B"])
@pytest.mark.parametrize("tp", [4, 8])
def test_gemm_shapes_follow_the_strategies(suite, preset: str, tp: int) -> None:
    cfg = suite.model_config(preset, "cola", 32000)
    d, r, f, tokens = cfg.dim, cfg.rank, cfg.ffn_dim, 8192
    vanilla = suite.linear_gemms(cfg, "vanilla", tp, tokens)
    btp = suite.linear_gemms(cfg, "btp", tp, tokens)
    fwd = lambda gemms: {g.name: (g.m, g.k, g.n) for g in gemms}  # noqa: E731
    # Vanilla's B reduces over r/t; BTP's grouped A reduces over d/t and writes all of r.
    assert fwd(vanilla)["q_proj.B"] == (tokens, r // tp, d)
    assert fwd(btp)["qkv.A"] == (tokens, d // tp, 3 * r)
    assert fwd(btp)["gate_up.B"] == (tokens, r, f // tp)
    assert {g.name for g in btp} >= {"qkv.A", "qkv.A.dgrad", "qkv.A.wgrad"}
    # Forward + input grad + weight grad of every linear: three shapes each.
    assert len(btp) % 3 == 0 and len(vanilla) == 3 * 14
    # The utilisation claim in shapes: BTP's least intense GEMM beats vanilla's.
    worst = lambda gemms: min(g.intensity(2) for g in gemms)  # noqa: E731
    assert worst(btp) > 2 * worst(vanilla)


def test_cpu_tiny_dry_run_writes_both_reports(suite, tmp_path: Path) -> None:
    suite.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    md = (tmp_path / "gpu_suite.md").read_text()
    gemm, train = report["gemm"], report["train"]
    assert {(r["preset"], r["tp"], r["strategy"]) for r in gemm["rows"]} == {
        (p, t, s) for p in ("tiny", "small") for t in (2, 4) for s in ("vanilla", "btp")
    }
    for row in gemm["rows"]:
        assert row["block_linear_tflops"] > 0 and row["min_intensity"] <= row["mean_intensity"]
        assert all(g["tflops"] > 0 and g["seconds"] > 0 for g in row["gemms"])
    assert {(r["preset"], r["arch"], r["mode"]) for r in train["rows"]} == {
        (p, a, "eager") for p in ("tiny", "small") for a in ("full", "cola")
    }
    assert all(r["tokens_per_s"] > 0 and r["loss"] == r["loss"] for r in train["rows"])
    assert "needs 2 or more" in report["tp"]["skipped"]
    assert "| tiny | 2 | btp |" in md and "| small | cola | eager |" in md
    assert report["elapsed_s"] < 60


def test_a_spent_budget_is_reported_not_dropped(suite, tmp_path: Path) -> None:
    suite.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "0"])
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["gemm"]["rows"] == [] and len(report["gemm"]["skipped"]) == 8
    assert report["train"]["rows"] == [] and len(report["train"]["skipped"]) == 4
    assert "skipped (budget)" in (tmp_path / "gpu_suite.md").read_text()
