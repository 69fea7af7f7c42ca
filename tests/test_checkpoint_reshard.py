"""A checkpoint saved at one layout resumes at any other (docs/design.md §5), with real gloo ranks.

The first resumed step runs from the loaded weights, so its loss equals the uninterrupted
run's up to fp32 reduction order (``LOSS_TOL``, as in the 3D tests). The second step adds
one AdamW update from the loaded moments with gradients that agree to fp32 noise (3D tests);
a wrong moment, data position or learning rate moves it by ~1e-2, far outside ``STEP2_TOL``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_train import tiny_run_config, train_rows

from boostlr.config import build_config
from boostlr.rundir.checkpoint import list_checkpoints
from boostlr.train import run as trainer

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-5  # relative, from identical weights (tests/test_parallel_3d.py)
STEP2_TOL = 1e-4  # relative, one AdamW step from gradients equal to fp32 noise
GLOBAL_BATCH = 8


def layout(pp: int, dp: int, tp: int, strategy: str = "auto") -> dict[str, object]:
    """Overrides for a layout with the same global batch (so the same data per step)."""
    micro = GLOBAL_BATCH // dp
    accum = 2 if pp * dp * tp == 1 else 1  # one process: the batch split in two
    return {
        "parallel.pp": pp,
        "parallel.dp": dp,
        "parallel.tp": tp,
        "parallel.tp_strategy": strategy,
        "train.batch_size": micro // accum,
        "train.grad_accum": accum,
    }


def run_config(data: Path, **overrides: object):
    return tiny_run_config(
        data,
        **{"model.n_layers": 4, "train.steps": 4, "train.ckpt_every": 2, **overrides},
    )


def resume_at(source: Path, target: Path, overrides: dict[str, object]) -> dict[int, float]:
    """Copy ``source`` without its last checkpoint and resume it at another layout."""
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step_4")
    cfg = build_config(target / "config.toml", [(k, str(v)) for k, v in overrides.items()])
    trainer.train(cfg, target, resume=True, console=False)
    return train_rows(target)


def assert_continues(expected: dict[int, float], got: dict[int, float], label: str) -> None:
    assert got[1] == expected[1] and got[2] == expected[2], label  # kept from the source
    assert abs(got[3] - expected[3]) <= LOSS_TOL * abs(expected[3]), (label, got, expected)
    assert abs(got[4] - expected[4]) <= STEP2_TOL * abs(expected[4]), (label, got, expected)


def test_pp2_tp2_checkpoint_resumes_at_every_other_layout(
    small_dataset: Path, tmp_path: Path
) -> None:
    source = tmp_path / "pp2_tp2"
    trainer.train(run_config(small_dataset, **layout(2, 1, 2)), source, console=False)
    assert list_checkpoints(source / "checkpoints")[-1].meta["layout"]["pp"] == 2
    expected = train_rows(source)
    # No tp 4 target (CI's time): tp shards are re-cut by one_process (tp 2 -> 1) and by the
    # vanilla -> btp test below; pp 2 -> 1 by dp2_tp2 and one_process.
    for name, (pp, dp, tp) in {
        "dp2_tp2": (1, 2, 2),
        "pp2_dp2": (2, 2, 1),
        "one_process": (1, 1, 1),
    }.items():
        got = resume_at(source, tmp_path / name, layout(pp, dp, tp))
        assert_continues(expected, got, name)


def test_vanilla_checkpoint_resumes_under_btp_and_one_process_under_dp2(
    small_dataset: Path, tmp_path: Path
) -> None:
    vanilla = tmp_path / "vanilla"
    trainer.train(run_config(small_dataset, **layout(1, 1, 2, "vanilla")), vanilla, console=False)
    got = resume_at(vanilla, tmp_path / "btp", layout(1, 1, 2, "btp"))
    assert_continues(train_rows(vanilla), got, "vanilla -> btp")

    single = tmp_path / "single"
    trainer.train(run_config(small_dataset, **layout(1, 1, 1)), single, console=False)
    got = resume_at(single, tmp_path / "dp2", layout(1, 2, 1))
    assert_continues(train_rows(single), got, "one process -> dp2")
    fsdp_vocab = {**layout(1, 2, 1), "parallel.vocab_dp": "false"}  # the tables FSDP units
    got = resume_at(single, tmp_path / "dp2_fsdp_vocab", fsdp_vocab)
    assert_continues(train_rows(single), got, "one process -> dp2, vocabulary as FSDP units")
