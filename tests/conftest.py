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
