"""TensorBoard event files mirror metrics.jsonl; a missing logger package is a config error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from boostlr.config import build_config
from boostlr.errors import ConfigError
from boostlr.train import loop

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _cfg(data: Path, *extra: tuple[str, str]):
    base = [
        ("model.preset", "tiny"),
        ("data.path", str(data)),
        ("data.seq_len", "32"),
        ("data.val_batches", "1"),
        ("train.batch_size", "2"),
        ("train.steps", "4"),
        ("train.log_every", "1"),
        ("train.eval_every", "2"),
        ("train.ckpt_every", "2"),
        ("parallel.device", "cpu"),
    ]
    return build_config(overrides=[*base, *extra])


def _events(run: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(
        str(run / "tb"),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
    )
    acc.Reload()
    return acc


def test_tensorboard_holds_every_logged_scalar(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    loop.train(_cfg(small_dataset, ("train.tensorboard", "true")), run, console=False)
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
    loop.train(_cfg(small_dataset, ("train.tensorboard", "true")), run, console=False)
    # Resume from step 2 (the step-4 checkpoint removed): steps 3-4 are logged again.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_4")
    cfg = build_config(run / "config.toml")
    loop.train(cfg, run, resume=True, console=False)
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
    monkeypatch: pytest.MonkeyPatch, key: str, value: str, module: str, message: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` fail
    with pytest.raises(ConfigError, match=message) as info:
        build_config(overrides=[(key, value)])
    assert "\n" not in str(info.value)


def test_wandb_sink_logs_every_row_and_keeps_its_id(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ``wandb`` module records what the sink calls (wandb is not a CI dependency)."""
    import types

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, values: dict, step: int) -> None:
            calls["log"].append((step, values))

        def finish(self) -> None:
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    fake = types.ModuleType("wandb")
    fake.init = init
    fake.util = types.SimpleNamespace(generate_id=lambda: "abc123")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    loop.train(_cfg(small_dataset, ("train.wandb", "proj")), run, console=False)
    (kwargs,) = calls["init"]
    assert kwargs["project"] == "proj" and kwargs["id"] == "abc123" and kwargs["name"] == "run"
    assert kwargs["config"]["train"]["wandb"] == "proj" and calls["finish"] == [True]
    assert (run / "wandb_id").read_text().strip() == "abc123"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(step, set(values)) for step, values in calls["log"]]
    expected = [
        (r["step"], {k for k, v in r.items() if k != "step" and not isinstance(v, bool)})
        for r in rows
    ]
    assert logged == expected
