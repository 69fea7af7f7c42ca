"""TensorBoard and W&B mirror metrics.jsonl; a missing logger package is a config error."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
from test_train import tiny_run_config

from boostlr.config import build_config
from boostlr.errors import ConfigError
from boostlr.train import run as trainer
from boostlr.train import saving, sinks

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _cfg(data: Path, *extra: tuple[str, str]):
    """test_train's tiny run, shortened: 4 steps of 2 sequences, eval and checkpoint every 2."""
    return tiny_run_config(
        data,
        **{
            "data.val_batches": 1,
            "train.batch_size": 2,
            "train.steps": 4,
            "train.warmup": 30,
            "train.eval_every": 2,
            "train.ckpt_every": 2,
            **dict(extra),
        },
    )


def _events(run: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(
        str(run / "tb"),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
    )
    acc.Reload()
    return acc


def test_tensorboard_holds_every_logged_scalar(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer.train(_cfg(small_dataset, ("train.tensorboard", "true")), run, console=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    acc = _events(run)
    tags = set(acc.Tags()["scalars"])
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, {})[row["step"]] = float(value)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl"} <= set(expected)
    assert tags == set(expected)
    for key, by_step in expected.items():
        logged = {e.step: e.value for e in acc.Scalars(key)}
        assert logged.keys() == by_step.keys(), key
        for step, value in by_step.items():
            assert logged[step] == pytest.approx(value, rel=1e-6), (key, step)
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]
    assert "config" in "".join(acc.Tags()["tensors"])  # the config as a text summary


def test_tensorboard_resume_drops_the_redone_steps(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer.train(_cfg(small_dataset, ("train.tensorboard", "true")), run, console=False)
    # Resume from step 2 (the step-4 checkpoint removed): steps 3-4 are logged again.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_4")
    cfg = build_config(run / "config.toml")
    trainer.train(cfg, run, resume=True, console=False)
    steps = [e.step for e in _events(run).Scalars("loss")]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("key", "value", "module", "message"),
    [
        ("train.wandb", "my-project", "wandb", "train.wandb needs the wandb package"),
        ("train.tensorboard", "true", "torch.utils.tensorboard", "pip install tensorboard"),
    ],
)
def test_missing_logger_package_is_one_line_config_error(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    key: str,
    value: str,
    module: str,
    message: str,
) -> None:
    """Checked when training starts, before any work; the config itself stays valid (so
    ``boostlr plan`` of it needs no logger package)."""
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` fail
    cfg = build_config(overrides=[(key, value)])
    with pytest.raises(ConfigError, match=message) as info:
        trainer.train(cfg, tmp_path / "run", console=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("wandb_step", [0, 3])
def test_wandb_sink_logs_every_row_and_keeps_its_id(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wandb_step: int
) -> None:
    """A stand-in ``wandb`` module records the calls (the real package is tested below).

    ``wandb_step`` 3: the W&B run already holds steps 1-2 (an online resume), so rows before
    step 3 are not sent (wandb would drop them with a warning each).
    """
    import types

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        step = wandb_step

        def log(self, values: dict, step: int) -> None:
            assert step >= self.step  # as wandb: history only moves forward
            self.step = step
            calls["log"].append((step, values))

        def finish(self, exit_code: int | None = None) -> None:
            calls["finish"].append(exit_code)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    fake = types.ModuleType("wandb")
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sinks, "new_run_id", lambda: "abc123")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = tmp_path / "run"
    trainer.train(_cfg(small_dataset, ("train.wandb", "proj")), run, console=False)
    (kwargs,) = calls["init"]
    assert kwargs["project"] == "proj" and kwargs["id"] == "abc123" and kwargs["name"] == "run"
    assert kwargs["dir"] == str(run) and kwargs["settings"] == {"silent": True}  # console=False
    assert kwargs["config"]["train"]["wandb"] == "proj" and calls["finish"] == [0]
    assert (run / "wandb_id").read_text().strip() == "abc123"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(step, set(values)) for step, values in calls["log"]]
    expected = [
        # every number; per-rank lists (a save's ckpt_*_by_rank) stay in metrics.jsonl only
        (r["step"], {k for k, v in r.items() if k != "step" and not isinstance(v, (bool, list))})
        for r in rows
        if r["step"] >= wandb_step
    ]
    assert logged == expected and logged[0][0] == max(1, wandb_step)


def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file, decoded with wandb's own protobuf schema.

    wandb ships no Python reader for the file (its Go core reads it for ``wandb sync``): a
    ``:W&B`` header (magic 0xBEE1, version 0), then LevelDB-log framing in 32 KiB blocks,
    each chunk ``crc32(type + data) u32, length u16, type u8`` (1 full, 2 first, 3 middle,
    4 last), a block's tail under 7 bytes zero padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pos, pending = [], 7, b""
    while pos < len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        assert kind in (1, 2, 3, 4) and zlib.crc32(bytes([kind]) + chunk) == crc, pos
        pending += chunk
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The real wandb, offline and silent, writing under the yielded WANDB_DIR."""
    wandb = pytest.importorskip("wandb")  # a dev dependency: CI has it
    wb = tmp_path / "wb"
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(wb),
        "WANDB_CONFIG_DIR": str(wb / "config"),
        "WANDB_CACHE_DIR": str(wb / "cache"),
        "WANDB_DATA_DIR": str(wb / "data"),
    }.items():
        monkeypatch.setenv(var, value)
    wandb.teardown()  # wandb reads WANDB_* once per session: a fresh one sees these values
    yield wb
    wandb.teardown()  # and its service process stops


def _offline_run(
    small_dataset: Path, tmp_path: Path, wb: Path, monkeypatch: pytest.MonkeyPatch, crash: bool
) -> tuple[Path, dict[str, list]]:
    """Train with the real wandb; the run directory and its .wandb file's records by type.

    ``crash``: the step-2 checkpoint save raises, so training ends by an exception.
    """
    run = tmp_path / "run"
    cfg = _cfg(small_dataset, ("train.wandb", "proj"))
    if crash:

        def broken_save(state, step: int) -> float:
            raise RuntimeError("disk full")

        monkeypatch.setattr(saving, "save", broken_save)
        with pytest.raises(RuntimeError, match="disk full"):
            trainer.train(cfg, run, console=False)
    else:
        trainer.train(cfg, run, console=False)
    # The records are written by wandb's service process; stopping it waits for the file to
    # be complete (a run that ended by an exception was otherwise read before its history).
    import wandb

    wandb.teardown()
    run_id = (run / "wandb_id").read_text().strip()
    (path,) = (wb / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    assert not (run / "wandb").exists()  # WANDB_DIR wins over the run directory
    by_type: dict[str, list] = {}
    for record in _wandb_records(path):
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    return run, by_type


def test_real_wandb_offline_run_holds_every_logged_scalar(
    small_dataset: Path, tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, records = _offline_run(small_dataset, tmp_path, wandb_dir, monkeypatch, crash=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    expected: dict[int, dict[str, float]] = {}  # the rows of one step make one W&B row
    for row in rows:
        expected.setdefault(row["step"], {}).update(sinks.scalars(row))
    logged: dict[int, dict[str, float]] = {}
    for record in records["history"]:
        items = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        step = record.history.step.num
        assert items["_step"] == step and step not in logged
        logged[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert sorted(logged) == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl"} <= set(logged[2])
    assert "ckpt_block_s" in logged[4] and "async" not in logged[4]
    assert logged.keys() == expected.keys()
    for step, values in expected.items():
        assert logged[step].keys() == values.keys(), step
        for key, value in values.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-12), (key, step)
    (meta,) = records["run"]
    assert (meta.run.run_id, meta.run.project, meta.run.display_name) == (
        (run / "wandb_id").read_text().strip(),
        "proj",
        "run",
    )
    config = {i.key: json.loads(i.value_json) for i in meta.run.config.update}
    assert config["train"]["wandb"] == "proj" and config["model"]["preset"] == "tiny"
    assert [r.exit.exit_code for r in records["exit"]] == [0]


def test_real_wandb_marks_a_crashed_run_failed(
    small_dataset: Path, tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, records = _offline_run(small_dataset, tmp_path, wandb_dir, monkeypatch, crash=True)
    assert [r.history.step.num for r in records["history"]] == [1, 2]
    assert [r.exit.exit_code for r in records["exit"]] == [1]
