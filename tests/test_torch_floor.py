"""The torch floor: one constant, equal to pyproject's bound, enforced at ``boostlr`` start."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from boostlr import _torch_floor
from boostlr._torch_floor import TORCH_FLOOR, TorchTooOld, check_torch_version, release
from boostlr.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_floor_is_pyprojects_torch_bound() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    torch_deps = [d for d in deps if re.match(r"torch\s*[<>=!~]", d)]
    assert torch_deps == [f"torch>={TORCH_FLOOR}"], torch_deps


def test_installed_torch_meets_the_floor() -> None:
    check_torch_version(torch.__version__)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.9.1+cu128", (2, 9, 1)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.10.0a0+git1234abc", (2, 10, 0)),
        ("2.9.0.dev20250801+cpu", (2, 9, 0)),
        ("2.9.0rc1", (2, 9, 0)),
        ("3.0", (3, 0)),
    ],
)
def test_release_reads_torch_version_strings(version: str, expected: tuple[int, ...]) -> None:
    assert release(version) == expected


@pytest.mark.parametrize("installed", ["2.8.0+cu128", "2.6.0", "1.13.1"])
def test_too_old_torch_is_one_line_naming_both_versions(installed: str) -> None:
    with pytest.raises(TorchTooOld) as info:
        check_torch_version(installed, floor="2.9")
    message = str(info.value)
    assert "\n" not in message
    assert f"torch {installed} is installed" in message and "torch>=2.9" in message


@pytest.mark.parametrize("installed", ["2.9.0", "2.9.0a0+gitabc", "2.10.0", "3.0.0"])
def test_floor_and_newer_pass(installed: str) -> None:
    check_torch_version(installed, floor="2.9")


def test_boostlr_start_refuses_old_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The check runs before the command: even ``train`` with a bad config never starts."""
    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    code = main(["train", "--run-dir", str(tmp_path / "run"), "--model.preset", "tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("boostlr: error: torch 2.6.0+cpu is installed"), err
    assert f"torch>={TORCH_FLOOR}" in err[0]
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert _torch_floor.require_torch() is None
