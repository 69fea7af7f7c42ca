"""Resuming under a real torchrun when verifying the checkpoint outlasts the collective timeout.

``BOOSTLR_SLOW_HASH`` makes hashing as slow as a huge checkpoint on a slow file system:
verifying this one on a single rank would take about five times ``parallel.timeout_s``.
The ranks hash equal shares at once and wait for each other only on a gloo group sized to
the checkpoint, so the resume succeeds; a rank left waiting on that group past its
timeout ends the job with one line that names the group and the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import tiny_args

pytestmark = pytest.mark.slow

TIMEOUT_S = 2
PACE_S_PER_MIB = 6.0  # the checkpoint below is ~1.7 MiB: ~10 s to verify on one rank


def torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "boostlr.cli", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def saved_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("torchrun") / "run"
    done = torchrun([*tiny_args(small_dataset, run, steps=2), "--parallel.dp", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def checkpoint_mib(run: Path, step: int) -> float:
    meta = json.loads((run / "checkpoints" / f"step_{step}" / "meta.json").read_text())
    return sum(f["size"] for f in meta["files"].values()) / 2**20


def resume_args(run: Path, steps: int) -> list[str]:
    return ["train", "--run-dir", str(run), "--resume", "--quiet", f"--train.steps={steps}"]


def test_a_resume_whose_verification_outlasts_the_timeout_succeeds(saved_run: Path) -> None:
    one_rank_s = checkpoint_mib(saved_run, 2) * PACE_S_PER_MIB
    assert one_rank_s > 4 * TIMEOUT_S  # the old rank-0-alone verification would time out
    started = time.perf_counter()
    done = torchrun(
        [*resume_args(saved_run, 4), "--parallel.dp", "2", "--parallel.timeout_s", str(TIMEOUT_S)],
        env={"BOOSTLR_SLOW_HASH": str(PACE_S_PER_MIB)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.perf_counter() - started > one_rank_s / 2  # the slow hashing really ran
    rows = [json.loads(line) for line in (saved_run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 4
    saves = [r for r in rows if "ckpt_block_s" in r]
    assert [r["step"] for r in saves] == [2, 4]
    for row in saves:  # every save row: each rank's blocked seconds and shard bytes
        assert len(row["ckpt_block_s_by_rank"]) == len(row["ckpt_bytes_by_rank"]) == 2
        assert all(b > 0 for b in row["ckpt_bytes_by_rank"])
        assert row["ckpt_bytes"] == sum(row["ckpt_bytes_by_rank"])


def test_a_timed_out_collective_is_one_line_naming_the_group(saved_run: Path) -> None:
    done = torchrun(  # only rank 1 hashes slowly: rank 0 waits past the group's timeout
        [*resume_args(saved_run, 6), "--parallel.dp", "2", "--parallel.timeout_s", str(TIMEOUT_S)],
        env={"BOOSTLR_SLOW_HASH": f"{PACE_S_PER_MIB}@1"},
    )
    assert done.returncode != 0
    # Rank 0 times out; rank 1 then finds it gone (one "lost a peer" line) or, if it gets
    # there while rank 0 is still leaving, times out as well: one line per rank at most.
    lines = [line for line in done.stderr.splitlines() if "timed out after" in line]
    assert 1 <= len(lines) <= 2, done.stderr[-3000:]
    assert "boostlr: rank 0: the checkpoint verification (gloo) group timed out" in lines[0]
    for line in lines:
        assert line.startswith("boostlr: rank ") and "verification (gloo) group" in line
        timeout = float(line.split("timed out after ")[1].split(" s")[0])
        assert TIMEOUT_S <= timeout < TIMEOUT_S + 1  # scaled to this small checkpoint
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr
