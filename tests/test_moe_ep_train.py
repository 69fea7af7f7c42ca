"""Expert parallelism in the trainer (``boostlr train --parallel.ep N``), on real gloo ranks.

dp 2 x ep 2 trains as dp 2 at ep 1 (the same global batch from the same weights: the first
loss to fp32 reduction order, the curve as the dp tests allow); its rows carry the ep traffic
and dense / ep 1 rows keep their keys; a resume at the same ep is bitwise; a checkpoint saved
at ep 2 holds each expert shard once, written by its owner, and resumes at ep 1, at ep 4
(dp 4) and at dp 4 x ep 2 (two replicas of each shard) with the next step's loss equal to
fp32 noise (DCP reshards the expert dim).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from test_train import read_rows, tiny_run_config, train_rows

from boostlr.config import build_config
from boostlr.rundir.checkpoint import list_checkpoints
from boostlr.train import run as trainer

MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
GLOBAL_BATCH = 8
LOSS_TOL = 1e-5  # relative, from identical weights (tests/test_parallel_3d.py)
STEP2_TOL = 1e-4  # relative, one AdamW step from gradients equal to fp32 noise
CURVE_TOL = 1e-3  # relative, trajectories that drift apart (tests/test_moe_train.py's dp2)
EXPERT = "layers.1.mlp.experts.gate_proj.up.weight"


def ep_config(data: Path, dp: int, ep: int, **extra: object):
    """Six steps, global batch 8 at any dp (so every layout reads the same data per step)."""
    layout = {"parallel.dp": dp, "parallel.ep": ep, "train.batch_size": 2}
    layout["train.global_batch"] = GLOBAL_BATCH
    return tiny_run_config(data, **{**MOE, **layout, **extra})


def grad_norm(run: Path, step: int) -> float:
    return next(r["grad_norm"] for r in read_rows(run) if r.get("step") == step and "loss" in r)


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """dp 2 at ep 1 and at ep 2, and the dense model at dp 2, trained by the real trainer."""
    root = tmp_path_factory.mktemp("ep")
    out = {}
    for name, ep in (("ep1", 1), ("ep2", 2)):
        out[name] = root / name
        trainer.train(ep_config(small_dataset, 2, ep), out[name], console=False)
    out["dense"] = root / "dense"
    dense = {"parallel.dp": 2, "train.batch_size": 2, "train.global_batch": GLOBAL_BATCH}
    trainer.train(tiny_run_config(small_dataset, **dense), out["dense"], console=False)
    return out


def test_dp2_ep2_trains_as_dp2_and_reports_ep_traffic(runs: dict[str, Path]) -> None:
    dense, ep = train_rows(runs["ep1"]), train_rows(runs["ep2"])
    assert list(ep) == [1, 2, 3, 4, 5, 6]
    assert abs(ep[1] - dense[1]) <= LOSS_TOL * dense[1]  # same weights, same batch
    for step in dense:
        assert abs(ep[step] - dense[step]) <= CURVE_TOL * dense[step], (step, ep, dense)
    assert ep[6] < ep[1]
    norm, norm_ref = grad_norm(runs["ep2"], 1), grad_norm(runs["ep1"], 1)
    assert abs(norm - norm_ref) <= LOSS_TOL * norm_ref, (norm, norm_ref)  # the experts' dp mean
    rows = [r for r in read_rows(runs["ep2"]) if "loss" in r]
    assert all(r["comm_ep_bytes"] > 0 and r["comm_ep_time_s"] > 0 for r in rows)
    plain = [r for r in read_rows(runs["ep1"]) if "loss" in r]
    assert set(rows[-1]) - set(plain[-1]) == {"comm_ep_bytes", "comm_ep_time_s"}
    assert not any(k.startswith("comm_ep") for r in plain for k in r)
    dense_rows = [r for r in read_rows(runs["dense"]) if "loss" in r]
    for moe_row, dense_row in zip(plain, dense_rows, strict=True):  # ep 1: today's keys
        assert {k for k in moe_row if not k.startswith("moe_")} == set(dense_row)
    saved = (runs["ep2"] / "config.toml").read_text()
    assert "ep = 2" in saved and "ep =" not in (runs["ep1"] / "config.toml").read_text()
    assert list_checkpoints(runs["ep2"] / "checkpoints")[-1].meta["layout"]["ep"] == 2
    for name in ("ep1", "dense"):  # written only away from the default
        assert "ep" not in list_checkpoints(runs[name] / "checkpoints")[-1].meta["layout"]


def test_a_checkpoint_holds_each_expert_shard_once(runs: dict[str, Path]) -> None:
    """Each ep rank writes its own rows of an expert weight: nothing gathers all experts."""
    step = list_checkpoints(runs["ep2"] / "checkpoints")[-1].path
    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    found = [k for k in meta if k.endswith(EXPERT)]
    assert found, sorted(meta)[:20]
    for key in found:
        chunks = meta[key].chunks
        rows = sorted((c.offsets[0], c.sizes[0]) for c in chunks)
        assert rows == [(0, 2), (2, 2)], (key, rows)  # E = 4 over ep 2: two rows per rank


def test_ep2_resumes_bitwise(runs: dict[str, Path], tmp_path: Path) -> None:
    again = tmp_path / "again"
    shutil.copytree(runs["ep2"], again)
    shutil.rmtree(again / "checkpoints" / "step_6")
    trainer.train(build_config(again / "config.toml"), again, resume=True, console=False)
    assert train_rows(again) == train_rows(runs["ep2"])


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (4, 4), (4, 2)])
def test_an_ep2_checkpoint_resumes_at_another_ep(
    runs: dict[str, Path], tmp_path: Path, dp: int, ep: int
) -> None:
    target = tmp_path / f"dp{dp}_ep{ep}"
    shutil.copytree(runs["ep2"], target)
    shutil.rmtree(target / "checkpoints" / "step_6")
    overrides = {"parallel.dp": dp, "parallel.ep": ep}
    cfg = build_config(target / "config.toml", [(k, str(v)) for k, v in overrides.items()])
    trainer.train(cfg, target, resume=True, console=False)
    expected, got = train_rows(runs["ep2"]), train_rows(target)
    assert all(got[s] == expected[s] for s in (1, 2, 3))  # kept from the source
    assert abs(got[4] - expected[4]) <= LOSS_TOL * expected[4], (got, expected)
    norm, norm_ref = (grad_norm(run, 4) for run in (target, runs["ep2"]))
    assert abs(norm - norm_ref) <= LOSS_TOL * norm_ref, (norm, norm_ref)  # every gradient's
    assert abs(got[5] - expected[5]) <= STEP2_TOL * expected[5], (got, expected)


def test_pp2_dp2_ep2_trains_as_dp2_with_every_stages_moe_keys(
    runs: dict[str, Path], small_dataset: Path, tmp_path: Path
) -> None:
    """A pipeline of MoE stages: the first loss and gradient norm equal dp 2's, and rank 0's
    rows carry every stage's MoE layers (summed over pp), the later stage's too."""
    run = tmp_path / "pp2"
    trainer.train(ep_config(small_dataset, 2, 2, **{"parallel.pp": 2}), run, console=False)
    got, expected = train_rows(run), train_rows(runs["ep1"])
    assert abs(got[1] - expected[1]) <= LOSS_TOL * expected[1], (got, expected)
    norm, norm_ref = grad_norm(run, 1), grad_norm(runs["ep1"], 1)
    assert abs(norm - norm_ref) <= LOSS_TOL * norm_ref, (norm, norm_ref)
    for step in expected:
        assert abs(got[step] - expected[step]) <= CURVE_TOL * expected[step], (step, got)
    rows = [r for r in read_rows(run) if "loss" in r]
    ref_rows = [r for r in read_rows(runs["ep1"]) if "loss" in r]
    moe_keys = {k for k in ref_rows[0] if k.startswith("moe_")}
    assert {"moe_load/0", "moe_load/1", "moe_bias_spread"} <= moe_keys
    assert all(moe_keys <= set(r) and r["comm_pp_bytes"] > 0 for r in rows)
    assert rows[0]["moe_load/1"] == pytest.approx(ref_rows[0]["moe_load/1"], rel=1e-6)
