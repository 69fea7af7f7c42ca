"""The trainer runs an MoE model under BTP (``boostlr train --parallel.tp 2``), on real gloo
ranks: tp 2 trains as one device does (the same global batch from the same weights: the
first loss to fp32 reduction order, the curve as the dp tests allow, the gradient norm at
step 1 to fp32 noise); the layouts MoE does not run under tp are refused in one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_train import read_rows, tiny_run_config, train_rows

from boostlr.cli import main
from boostlr.config import build_config
from boostlr.errors import ConfigError
from boostlr.train import run as trainer

MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
LOSS_TOL = 1e-5  # relative, from identical weights (tests/test_parallel_3d.py)
CURVE_TOL = 1e-3  # relative, trajectories that drift apart (tests/test_moe_ep_train.py)


def _grad_norm(run: Path, step: int) -> float:
    return next(r["grad_norm"] for r in read_rows(run) if r.get("step") == step and "loss" in r)


@pytest.mark.parametrize(("dp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_tp2_btp_trains_as_one_device(
    small_dataset: Path, tmp_path: Path, dp: int, pp: int
) -> None:
    """tp 2 (dp 2 x tp 2: FSDP around the BTP MoE blocks; pp 2 x tp 2: MoE stages) against
    one device."""
    runs = {}
    for tp, ranks, stages in ((1, 1, 1), (2, dp, pp)):
        runs[tp] = tmp_path / f"tp{tp}"
        layout = {"parallel.tp": tp, "parallel.dp": ranks, "train.batch_size": 4 // ranks}
        layout["parallel.pp"] = stages
        cfg = tiny_run_config(small_dataset, **MOE, **layout, **{"train.global_batch": 4})
        trainer.train(cfg, runs[tp], console=False)
    one, two = train_rows(runs[1]), train_rows(runs[2])
    assert list(two) == [1, 2, 3, 4, 5, 6]
    assert abs(two[1] - one[1]) <= LOSS_TOL * one[1]
    for step in one:
        assert abs(two[step] - one[step]) <= CURVE_TOL * one[step], (step, one, two)
    assert two[6] < two[1]
    norm, norm_ref = _grad_norm(runs[2], 1), _grad_norm(runs[1], 1)
    assert abs(norm - norm_ref) <= LOSS_TOL * norm_ref, (norm, norm_ref)
    rows = [r for r in read_rows(runs[2]) if "loss" in r]
    assert all(r["comm_tp_bytes"] > 0 for r in rows)
    if dp == pp == 1:
        _resumes(runs[2], tmp_path)


def _resumes(run: Path, tmp_path: Path) -> None:
    """The tp 2 checkpoint of step 3 resumes bit for bit at tp 2, and at tp 1 (the experts
    and routers whole in it, the factors resharded) to fp32 noise."""
    expected = train_rows(run)
    for tp in (2, 1):
        target = tmp_path / f"resume_tp{tp}"
        shutil.copytree(run, target)
        shutil.rmtree(target / "checkpoints" / "step_6")
        cfg = build_config(target / "config.toml", [("parallel.tp", str(tp))])
        trainer.train(cfg, target, resume=True, console=False)
        got = train_rows(target)
        if tp == 2:
            assert got == expected
        else:
            assert all(got[s] == expected[s] for s in (1, 2, 3))  # kept from the source
            assert abs(got[4] - expected[4]) <= LOSS_TOL * expected[4], (got, expected)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"parallel.tp": 2, "parallel.tp_strategy": "vanilla"}, "runs under tp strategy btp only"),
        ({"parallel.tp": 2, "model.moe_dispatch": "hidden"}, "moe_dispatch hidden runs on the"),
        ({"parallel.tp": 2, "model.moe_capacity": 1.0}, "not supported with parallel.tp > 1"),
    ],
)
def test_moe_layouts_tp_does_not_run_are_refused(small_dataset: Path, extra, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        tiny_run_config(small_dataset, **MOE, **extra)
    assert "\n" not in str(err.value)


def test_plan_prices_the_btp_moe_block(capsys: pytest.CaptureFixture[str]) -> None:
    """``boostlr plan`` at tp 2 shows the one MoE row BTP runs (latent dispatch), its
    receive bound counted on each TP rank's share of the tokens."""
    args = ["plan", "--hardware", "h200", "--model.preset", "tiny", "--parallel.tp", "2"]
    args += ["--data.seq_len", "256", "--train.batch_size", "4", "--json"]
    assert main(args + [f"--{k}={v}" for k, v in MOE.items()]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["arch"], r["moe"]["dispatch"], r["layout"]["tp"]) for r in rows] == [
        ("cola", "latent", 2)
    ]
    assert rows[0]["moe"]["receive"]["balanced_rows"] == 4 * 256 // 2 * MOE["model.moe_top_k"]
