"""Resume guards, the learning rate across an extended run, and damaged checkpoints."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
from test_cli import run_cli, tiny_args
from test_train import read_rows, tiny_run_config

from boostlr.config import build_config
from boostlr.errors import CheckpointError
from boostlr.fsutil import sha256_file
from boostlr.rundir.checkpoint import list_checkpoints
from boostlr.rundir.layout import META_FILE
from boostlr.train import run as trainer
from boostlr.train.optim import lr_at


@pytest.fixture(scope="module")
def finished_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("guards") / "run"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 4, "train.ckpt_every": 2}), run)
    return run


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("data.seq_len", "16"),
        ("train.batch_size", "8"),  # the global batch changes
        ("train.seed", "1"),
        ("train.lr", "0.001"),
        ("train.warmup", "1"),
        ("train.weight_decay", "0.0"),
        ("train.beta1", "0.8"),
        ("train.beta2", "0.99"),
        ("train.dtype", "bfloat16"),
    ],
)
def test_resume_refuses_changes_to_data_order_or_optimizer(
    finished_run: Path, key: str, value: str
) -> None:
    cfg = build_config(finished_run / "config.toml", [(key, value), ("train.steps", "8")])
    before = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match=key.split(".")[1]) as err:
        trainer.train(cfg, finished_run, resume=True, console=False)
    assert "drop the overrides" in str(err.value)
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir()) == before


def test_resume_refuses_another_data_path(finished_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "data"
    shutil.copytree(build_config(finished_run / "config.toml").data.path, other)
    cfg = build_config(finished_run / "config.toml", [("data.path", str(other))])
    with pytest.raises(CheckpointError, match="data.path"):
        trainer.train(cfg, finished_run, resume=True, console=False)


def test_same_global_batch_with_another_split_is_accepted(
    small_dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 2}), run, console=False)
    cfg = build_config(
        run / "config.toml",
        [("train.batch_size", "2"), ("train.grad_accum", "2"), ("train.steps", "3")],
    )
    assert trainer.train(cfg, run, resume=True, console=False).step == 3


def test_extending_steps_keeps_the_learning_rate_continuous(
    small_dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    first = tiny_run_config(small_dataset, **{"train.steps": 6, "train.ckpt_every": 3})
    trainer.train(first, run, console=False)
    shutil.rmtree(run / "checkpoints" / "step_6")
    longer = build_config(run / "config.toml", [("train.steps", "12")])
    trainer.train(longer, run, resume=True, console=False)
    lrs = {r["step"]: r["lr"] for r in read_rows(run) if "lr" in r}
    # Step 4 (optimizer step index 3) is where the extended schedule takes over.
    assert lrs[4] == lr_at(3, first.train)  # no jump at the resume point
    decay = [lrs[s] for s in range(4, 13)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))  # still decaying
    floor = first.train.min_lr_ratio * first.train.lr
    # Cosine from the resume point's rate to the floor over the 9 remaining steps.
    expected_last = floor + 0.5 * (lrs[4] - floor) * (1 + math.cos(math.pi * 8 / 9))
    assert lrs[12] == pytest.approx(expected_last, rel=1e-12)
    # The anchor is saved: resuming the extended run again reproduces its rates.
    meta = json.loads((run / "checkpoints" / "step_12" / "trainer.json").read_text())
    assert meta["lr_schedule"] == {"steps": 12, "anchor": [3, lr_at(3, first.train)]}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "foreign"])
def test_damaged_checkpoints_exit_2_without_traceback(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = tmp_path / "run"
    assert run_cli(tiny_args(small_dataset, run, steps=2), capsys)[0] == 0
    (ckpt,) = list_checkpoints(run / "checkpoints")
    shard = ckpt.path / "__0_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif damage == "delete":
        shard.unlink()
    else:  # a meta.json from something else entirely
        (ckpt.path / META_FILE).write_text(json.dumps({"format": 99, "files": {}}))
    code, _, err = run_cli(["train", "--run-dir", str(run), "--resume", "--quiet"], capsys)
    assert code == 2, err
    assert "Traceback" not in err and "no complete checkpoint" in err
    code, _, err = run_cli(["export", str(ckpt.path), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "Traceback" not in err


class _Payload:
    """Unpickling this would create ``marker``: what a crafted checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_dcp_metadata_is_refused_not_executed(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, marker = tmp_path / "run", tmp_path / "pwned"
    assert run_cli(tiny_args(small_dataset, run, steps=2), capsys)[0] == 0
    (ckpt,) = list_checkpoints(run / "checkpoints")
    (ckpt.path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    meta = json.loads((ckpt.path / META_FILE).read_text())  # the attacker fixes the hashes
    meta["files"][".metadata"] = {
        "size": (ckpt.path / ".metadata").stat().st_size,
        "sha256": sha256_file(ckpt.path / ".metadata"),
    }
    (ckpt.path / META_FILE).write_text(json.dumps(meta))
    code, _, err = run_cli(["train", "--run-dir", str(run), "--resume", "--quiet"], capsys)
    assert code == 2 and "not allowed in DCP metadata" in err and "Traceback" not in err
    code, _, err = run_cli(["export", str(ckpt.path), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "Traceback" not in err
    assert not marker.exists()


def test_a_format_1_checkpoint_is_named_not_called_corrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / META_FILE).write_text(json.dumps({"format": 1, "step": 3, "files": {}}))
    code, _, err = run_cli(["export", str(step), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "Traceback" not in err
    assert "has format 1" in err and "reads format 2" in err
    assert not (tmp_path / "x").exists()
