"""``benchmarks/gpu_check.py --device cpu``: the GPU check's whole sequence as CI's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_cpu_dry_run_passes_with_bitwise_resume(small_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "check"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)]
    cmd += ["--data", str(small_dataset), "--steps", "8", "--every", "4", "--log-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"]
    outcome = {row["check"].split(" (")[0]: row["ok"] for row in report["checks"]}
    for name in ("train", "no host sync on quiet steps", "start-up", "speed", "export"):
        assert outcome[name] is True, (name, report["checks"])
    assert outcome["resume bit for bit"] is True and outcome["export's loss = checkpoint's"]
    assert report["resume"]["from_step"] == 4 and report["resume"]["compared"] >= 5
    assert report["resume"]["differ"] == 0
    assert report["first_row"]["build_s"] > 0 and report["first_row"]["build_s_ranks"]
    assert set(report["memory"]["phases_mb"]) >= {"materialise", "forward/backward", "save"}
    assert outcome["gpu_suite rows"] is None and outcome["distributed tests on NCCL"] is None
    assert "| resume bit for bit" in (out / "gpu_check.md").read_text()


def test_a_non_empty_out_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("x")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not empty" in done.stdout
