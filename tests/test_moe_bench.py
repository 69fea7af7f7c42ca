"""The MoE benchmarks' quick modes (tiny shapes, seconds) and their arithmetic.

``benchmarks/moe.py --quick`` runs real gloo ranks at ep 2 and 4: its tables must hold the
three variants with the ledger's ep bytes equal to the formula. ``convergence_moe.py
--quick`` trains the three models with the trainer: each must get the same training FLOPs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
LABELS = ("dense MoE", "CoLA hidden", "CoLA latent")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moe():
    sys.path.insert(0, str(BENCH))  # moe.py imports common.py as the script would
    yield _load("moe")
    sys.path.remove(str(BENCH))
    del sys.modules["moe_bench"]


@pytest.fixture(scope="module")
def conv():
    module = _load("convergence_moe")
    yield module
    del sys.modules["convergence_moe_bench"]


def test_moe_formula_is_3r_vs_2d_per_copy(moe) -> None:
    args = argparse.Namespace(batch=8, seq_len=16, top_k=2, rank=16, dim=64, layers=3, experts=4)
    for ep in (2, 4):
        counts = 3 * ep * 4 * 8  # 3 MoE layers x [ep, ep, E / ep] int64 gathered, forward only
        copies = 8 // ep * 16 * 2
        latent, hidden = (
            moe.formula_bytes(args, "latent", ep, ep),
            moe.formula_bytes(args, "hidden", ep, ep),
        )
        assert latent - counts == 3 * 2 * copies * 3 * 16 * 4  # 2r out + r back, fwd and bwd
        assert hidden - counts == 3 * 2 * copies * 2 * 64 * 4  # d out + d back


def _fake_ranks(moe, args: argparse.Namespace, ep: int, off: int) -> dict[int, dict]:
    """Per-rank results whose byte sums are the formula's (+ ``off`` on rank 0, step 0)."""
    ranks: dict[int, dict] = {r: {} for r in range(ep)}
    for label, _, dispatch in moe.VARIANTS:
        total = moe.formula_bytes(args, dispatch, ep, ep) * ep
        for r in range(ep):
            share = total // ep + (off if r == 0 else 0)
            ranks[r][label] = {
                "bytes": [share, total // ep],
                "times": [1.0, 1.0],
                "comm": [0.1, 0.1],
                "cpu": [0.5, 0.5],
                "state_mb": 1.0,
                "step_mb": 2.0,
            }
    return ranks


def test_moe_table_flags_a_ledger_that_differs_from_the_formula(moe) -> None:
    args = moe.parse(["--quick", "--ep", "2"])
    exact = moe.table(args, 2, 2, moe.summarize(args, 2, 2, _fake_ranks(moe, args, 2, 0)))
    assert "ledger = formula in every timed step, every variant: yes" in exact
    off = moe.table(args, 2, 2, moe.summarize(args, 2, 2, _fake_ranks(moe, args, 2, 8)))
    assert "ledger = formula in every timed step, every variant: NO" in off


@pytest.mark.slow
def test_moe_quick_tables() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "moe.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    tables = out.split("\n# moe: ")[1:]
    assert [t.split(" (", 1)[0] for t in tables] == ["dp 2 x ep 2", "dp 4 x ep 4"]
    for text in tables:
        for label in LABELS:
            row = re.search(rf"^{label} +([\d,]+) +([\d,]+) +([\d.]+) +([\d.]+) ", text, re.M)
            assert row, (label, text)
            ledger, formula, ratio, step_s = row.groups()
            assert ledger == formula and ratio == "1.000000" and float(step_s) > 0
        assert "ledger = formula in every timed step, every variant: yes" in text
        assert re.search(r"CoLA latent / dense MoE step time: [\d.]+ \(goal <= 0.7", text)
        assert re.search(r"CoLA latent / CoLA hidden step time: [\d.]+ \(goal <= 0.85", text)


def test_moe_flops_count_only_the_experts_a_token_uses(conv) -> None:
    """Dense MoE (k experts of f_e) minus the dense model (ffn k f_e): the routers only."""
    size = conv.FULL
    specs = conv.models(size)
    flops = {n: conv.model_flops(a, k, size["seq"], 4096) for n, (a, k) in specs.items()}
    moe, shape = size["moe"], size["shape"]
    router = 6 * shape["n_layers"] * moe["moe_experts"] * shape["dim"]
    assert flops["dense MoE"] - flops["dense"] == router
    assert flops["CoLA MoE latent"] < 0.7 * flops["dense MoE"]


def test_full_budgets_give_every_model_the_same_flops(conv) -> None:
    size = conv.FULL
    plan = conv.budgets(size, 4096, 8)
    specs = conv.models(size)
    tokens = size["batch"] * size["seq"]
    totals = {
        n: b.steps * tokens * conv.model_flops(specs[n][0], specs[n][1], size["seq"], 4096)
        for n, b in plan.items()
    }
    assert plan["dense"].steps == size["dense_steps"]
    assert all(abs(t / totals["dense"] - 1) < 0.005 for t in totals.values()), totals


def test_convergence_moe_quick(conv, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert conv.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("dense", "dense MoE", "CoLA MoE latent"):
        assert (tmp_path / name.replace(" ", "-") / "metrics.jsonl").is_file()
        assert re.search(rf"^{name} +[\d,]+ +[\d.e+]+ +\d+ +[\d.e+]+ ", out, re.M), name
    assert "dense MoE final validation loss" in out
    assert re.search(r"CoLA MoE latent: (reaches it at|does NOT reach it)", out)
    assert (tmp_path / "val_vs_flops.png").stat().st_size > 10_000
