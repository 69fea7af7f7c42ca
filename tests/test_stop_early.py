"""Stopping early to be resumed, with real processes, launchers and signals.

A run killed before its first checkpoint resumes from step 0 with its recorded config; a
SIGTERM to boostlr's launcher, to one rank, or to torchrun's agent (``BOOSTLR_SIGNAL_AT``
sends it at an exact point: the first step, a pipeline's warm-up, an evaluation, a save,
and again during the save it causes) makes every rank save the step it is in and exit 75;
resuming gives the uninterrupted run's losses. ``train.time_limit`` stops the same way.
srun's signals and SLURM's end time are in ``tests/test_launchers.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boostlr.errors import EXIT_STOPPED

STEPS = 6
ARGS = [
    "--quiet",
    "--model.preset", "tiny",
    "--data.seq_len", "32",
    "--data.val_batches", "2",
    "--train.steps", str(STEPS),
    "--train.warmup", "2",
    "--train.log_every", "1",
    "--train.eval_every", "3",
    "--train.ckpt_every", "3",
    "--parallel.device", "cpu",
]  # fmt: skip
DP2 = ["--parallel.dp", "2", "--train.batch_size", "2"]
PP2 = ["--parallel.pp", "2", "--train.batch_size", "4", "--model.n_layers", "2"]
TIMEOUT_S = 600


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(key, None)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=TIMEOUT_S)


def boostlr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "boostlr.cli", "train", *args], env)


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run([*launcher, "--nproc-per-node", "2", "-m", "boostlr.cli", "train", *args], env)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def saved_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir())


def assert_stopped(done: subprocess.CompletedProcess, run_dir: Path) -> int:
    """Exit 75 and one line naming the step it saved; that step's row and checkpoint."""
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "stopped at step" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    step = int(lines[0].split("stopped at step ")[1].split()[0])
    assert "(SIGTERM)" in lines[0] and "--resume" in lines[0] and "exit code 75" in lines[0]
    assert step in saved_steps(run_dir) and step in losses(run_dir)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # nothing half-written
    return step


@pytest.fixture(scope="module")
def reference(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run: boostlr starting dp 2 ranks itself."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = boostlr("--run-dir", str(run_dir), "--data.path", str(small_dataset), *ARGS, *DP2)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


def test_resume_before_the_first_save_starts_over_like_the_first_start(
    small_dataset: Path, tmp_path: Path
) -> None:
    """SIGKILL at step 2 of a run whose first save is at its end: ``--resume`` starts it
    again from step 0 with its config.toml and trains the same losses; a directory that
    holds no run stays an error."""
    args = [*ARGS, "--train.ckpt_every", "100", "--train.eval_every", "100", "--train.steps", "3"]
    first = tmp_path / "first"
    done = boostlr("--run-dir", str(first), "--data.path", str(small_dataset), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = tmp_path / "killed"
    done = boostlr(
        "--run-dir", str(killed), "--data.path", str(small_dataset), *args,
        env={"BOOSTLR_CRASH_AT": "step:2"},
    )  # fmt: skip
    assert done.returncode == -9 and saved_steps(killed) == []
    assert 1 in losses(killed)
    done = boostlr("--run-dir", str(killed), "--resume", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "no checkpoint yet" in line]
    assert len(said) == 1 and "starting it from step 0" in said[0], done.stderr
    assert losses(killed) == losses(first)  # bitwise: the same data order and arithmetic
    done = boostlr("--run-dir", str(tmp_path / "typo"), "--resume", "--quiet")
    assert done.returncode == 2 and "not found" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "points",
    [
        "forward:1@0>parent",  # the first step
        # an evaluation, the save after it, and a second signal during the stop's own save
        "eval:3@0>parent,ckpt_before_shards:3@0>parent,ckpt_before_shards:5@0>parent",
    ],
    ids=["first-step", "eval-save-second-signal"],
)
def test_sigterm_to_boostlrs_launcher_saves_and_resumes(
    small_dataset: Path, tmp_path: Path, reference: dict[int, float], points: str
) -> None:
    run_dir = tmp_path / "run"
    done = boostlr(
        "--run-dir", str(run_dir), "--data.path", str(small_dataset), *ARGS, *DP2,
        env={"BOOSTLR_SIGNAL_AT": points},
    )  # fmt: skip
    step = assert_stopped(done, run_dir)
    # The ranks agree one step after the step in whose check a rank first sees the signal
    # (stopping.StopCheck: a lag of one step). The launcher forwards it to the other rank
    # while that rank may still be before its own check of the signal's step, so the agreed
    # stop is one or two steps after the step the signal was sent in; the same on every rank.
    sent = 1 if points.startswith("forward") else 3
    assert step in (sent + 1, sent + 2), step
    if sent == 3:  # the periodic save the signal arrived in was finished, not dropped
        assert saved_steps(run_dir) == [3, step]
    done = boostlr("--run-dir", str(run_dir), "--resume", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir) == reference


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank", "agent"])
def test_sigterm_under_torchrun_in_the_pipeline_warm_up(
    small_dataset: Path, tmp_path: Path, reference: dict[int, float], target: str
) -> None:
    """pp 2 under torchrun, SIGTERM as the first stage starts step 2's warm-up: to that
    rank alone, or to torchrun's agent (which passes it on to both ranks)."""
    run_dir = tmp_path / "run"
    point = "forward:2@0" + (">parent" if target == "agent" else "")
    done = torchrun(
        "--run-dir", str(run_dir), "--data.path", str(small_dataset), *ARGS, *PP2,
        env={"BOOSTLR_SIGNAL_AT": point},
    )  # fmt: skip
    # torchrun exits 1 for any rank's non-zero exit; its ranks exit 75 (and say so).
    assert done.returncode != 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "stopped at step 3" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert saved_steps(run_dir) == [3] and not list((run_dir / "checkpoints").glob(".tmp-*"))
    done = boostlr("--run-dir", str(run_dir), "--resume", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = losses(run_dir)
    assert list(resumed) == list(reference)
    # pp 2 against the dp 2 reference: the same global batch, equal to fp32 rounding
    assert resumed == pytest.approx(reference, rel=1e-5)


def test_the_time_limit_saves_and_stops(small_dataset: Path, tmp_path: Path) -> None:
    """``train.time_limit`` counts from the process's start; the run stops with twice its
    save time (and two steps) still left, saved and resumable."""
    run_dir = tmp_path / "run"
    limit_s = 25
    started = time.time()
    done = boostlr(
        "--run-dir", str(run_dir), "--data.path", str(small_dataset), *ARGS,
        "--train.steps", "100000", "--train.time_limit", f"{limit_s}s",
    )  # fmt: skip
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    assert "(the time limit is near)" in done.stderr
    step = max(saved_steps(run_dir))
    published = (run_dir / "checkpoints" / f"step_{step}" / "meta.json").stat().st_mtime
    # The margin comes from measured step and save times; on a shared 2-core CI machine a
    # step can stall for seconds, so the save is allowed to land a little past the limit,
    # and a start-up slower than the limit itself stops after the first step.
    assert published - started < limit_s + 10 or step == 1, (published - started, step)
    assert step >= 1 and step in losses(run_dir)
    done = boostlr("--run-dir", str(run_dir), "--resume", "--quiet", f"--train.steps={step + 1}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert max(losses(run_dir)) == step + 1


DEATH_TIMEOUT_S = 60
MOE = ["--model.moe_experts", "4", "--model.moe_top_k", "2", "--model.moe_ffn_dim", "64"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.tp", "2", "--train.batch_size", "2"],
        DP2,
        PP2,
        [*DP2, "--parallel.ep", "2", *MOE],
    ],
    ids=["tp", "dp", "pp", "ep"],
)
def test_a_dead_rank_is_named_and_the_others_leave_in_time(
    small_dataset: Path, tmp_path: Path, layout: list[str]
) -> None:
    """Rank 1 is SIGKILLed (as by the OOM killer) as step 2 starts, so rank 0 meets its
    death in step 2's first collective of the layout: a TP all-reduce, the dp gradient
    all-reduce, the pipeline's send/recv, the ep all-to-all. Rank 0 leaves it well within
    ``parallel.timeout_s`` with one line, torchrun names rank 1 and SIGKILL, and the run
    directory holds nothing half-written."""
    run_dir = tmp_path / "run"
    done = torchrun(
        "--run-dir", str(run_dir), "--data.path", str(small_dataset), *ARGS, *layout,
        "--train.ckpt_every", "1", "--parallel.timeout_s", str(DEATH_TIMEOUT_S),
        env={"BOOSTLR_CRASH_AT": "forward:2@1"},
    )  # fmt: skip
    ended = time.time()
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "boostlr: rank 0: lost a peer rank" in done.stderr, output[-3000:]
    assert "crashed" not in done.stderr, output[-3000:]  # one line, not a traceback
    assert "SIGKILL" in output and re.search(r"rank\s*: 1 ", output), output[-3000:]
    step_1 = (run_dir / "checkpoints" / "step_1" / "meta.json").stat().st_mtime
    assert ended - step_1 < DEATH_TIMEOUT_S  # not waiting out the timeout
    assert saved_steps(run_dir) == [1] and not list((run_dir / "checkpoints").glob(".tmp-*"))
