"""The convergence benchmark's smoke mode (tiny shapes, seconds) and its FLOPs arithmetic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("convergence_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_flops_to_reach_interpolates_between_evaluations(bench) -> None:
    xs, ys = [1.0, 2.0, 3.0, 4.0], [5.0, 4.0, 3.0, 2.5]
    assert bench.flops_to_reach(xs, ys, 5.5) == 1.0
    assert bench.flops_to_reach(xs, ys, 3.5) == pytest.approx(2.5)
    assert bench.flops_to_reach(xs, ys, 2.5) == 4.0
    assert bench.flops_to_reach(xs, ys, 2.0) is None


def test_tiny_archs_smoke(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--tiny", "--part", "archs", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for arch in ("full", "cola", "svd", "lax"):
        assert (tmp_path / f"arch-{arch}" / "metrics.jsonl").is_file()
    assert "dense (full) final validation loss" in out
    assert "cola: " in out and ("reaches it at" in out or "does NOT reach it" in out)
    for name in ("val_vs_tokens.png", "val_vs_flops.png", "loss_vs_flops.png"):
        assert (tmp_path / name).stat().st_size > 10_000
