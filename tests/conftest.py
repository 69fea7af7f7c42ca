"""Shared fixtures: a small real dataset prepared once per session with the real pipeline."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from boostlr.data import prepare_dataset

# A handful of real standard-library sources: real text, real tokenizer, a few hundred KB.
_SOURCES = ("argparse.py", "textwrap.py", "dataclasses.py", "json/decoder.py", "string.py")


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("small_dataset") / "data"
    prepare_dataset(
        [stdlib / name for name in _SOURCES],
        out,
        tokenizer="bpe:512",
        val_fraction=0.2,
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def sharded_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CoLA run trained by the real trainer at TP 2, so its checkpoints are sharded."""
    from boostlr.config import build_config
    from boostlr.train import run as trainer

    overrides = {
        "model.preset": "tiny",
        "model.arch": "cola",
        "data.path": str(small_dataset),
        "data.seq_len": 32,
        "data.val_batches": 2,
        "train.batch_size": 4,
        "train.steps": 3,
        "train.warmup": 2,
        "train.eval_every": 3,
        "train.ckpt_every": 3,
        "parallel.tp": 2,
        "parallel.tp_strategy": "btp",
        "parallel.device": "cpu",
    }
    run = tmp_path_factory.mktemp("sharded") / "run"
    trainer.train(build_config(overrides=list(overrides.items())), run, console=False)
    return run
