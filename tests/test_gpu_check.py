"""``benchmarks/gpu_check.py --device cpu``: the GPU check's whole sequence as CI's dry run,
started as on the lent GPU machine (another working directory, none of the packages its image
lacks), and the pieces that keep its report true: the budget, process groups, the CUDA-thread
recorder (``gpu_check_rank.py``) and the cross-rank comparison of collectives
(``gpu_collectives.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCH / "gpu_check.py"
SRC = BENCH.parent / "src"
# boostlr's dependencies (pyproject, dev extra included) that the lent GPU machine's image
# lacks (its package list: the device notes); the check must run without them.
NOT_ON_THE_GPU_IMAGE = ("tomli_w", "wandb", "lm_eval")
BLOCKER = """
import sys

class _NotOnTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU image)")
        return None

sys.meta_path.insert(0, _NotOnTheImage())
"""

sys.path.insert(0, str(BENCH))  # as when run as a script: its sibling modules
from gpu_check_rank import CudaThreads  # noqa: E402
from gpu_check_run import BUDGET, Checks, run_group  # noqa: E402
from gpu_collectives import Call, compare  # noqa: E402


def image_like_env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH to this tree (the script finds its own), the image's missing imports fail."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(NOT_ON_THE_GPU_IMAGE)))
    return {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_cpu_dry_run_passes_with_bitwise_resume(small_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "check"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)]
    cmd += ["--data", str(small_dataset), "--steps", "8", "--every", "4", "--log-every", "2"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = image_like_env(tmp_path)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=elsewhere)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] and report["boostlr"] == str(SRC / "boostlr")
    outcome = {row["check"].split(" (")[0]: row["ok"] for row in report["checks"]}
    for name in ("train", "no host sync on quiet steps", "start-up", "speed", "export"):
        assert outcome[name] is True, (name, report["checks"])
    assert outcome["resume bit for bit"] is True and outcome["export's loss = checkpoint's"]
    assert report["resume"]["from_step"] == 4 and report["resume"]["compared"] >= 5
    assert report["resume"]["differ"] == 0 and report["determinism"]["enabled"]
    assert report["first_row"]["build_s"] > 0 and report["first_row"]["build_s_ranks"]
    assert set(report["memory"]["phases_mb"]) >= {"materialise", "forward/backward", "save"}
    assert outcome["gpu_suite rows"] is None and outcome["distributed tests on NCCL"] is None
    # The CPU run traces the same 3-D layout on CPU tensors: every rank, many collectives.
    assert outcome["collectives of pp2 x dp2 x tp2 agree across ranks"] is True
    calls = report["collectives"]["calls"]
    assert len(calls) == 8 and min(calls.values()) > 10 and not report["collectives"]["problems"]
    assert "| resume bit for bit" in (out / "gpu_check.md").read_text()
    assert not report["skipped_for_budget"]


def test_a_non_empty_out_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("x")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not empty" in done.stdout


def test_a_spent_budget_skips_from_another_folder_and_passes(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Started from elsewhere with no budget: it finds its own tree, and skips, never fails."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", "check", "--budget-s", "0"]
    cmd += ["--data", str(small_dataset)]
    env = image_like_env(tmp_path)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=elsewhere)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((elsewhere / "check" / "gpu_check.json").read_text())
    assert report["passed"] and report["boostlr"] == str(SRC / "boostlr")
    rows = {row["check"].split(" (")[0]: row for row in report["checks"]}
    assert rows["train"]["ok"] is None and rows["train"]["detail"].startswith(BUDGET)
    assert rows["collectives of pp2 x dp2 x tp2 agree across ranks"]["ok"] is None
    assert rows["collectives of pp2 x dp2 x tp2 agree across ranks"]["detail"].startswith(BUDGET)
    assert rows["resume bit for bit"]["ok"] is None
    assert len(report["skipped_for_budget"]) == 2
    assert not any(row["ok"] is False for row in report["checks"])


def test_a_step_that_outruns_the_budget_is_skipped_and_one_past_its_cap_fails(tmp_path) -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    checks = Checks(tmp_path, budget_s=1.0)
    step = checks.step(sleep, tmp_path / "a.log", cap_s=100)
    assert step.rc == 124 and step.budget_out and not step.hung and step.seconds < 30
    checks.timed_out("slow", step, tmp_path / "a.log")
    assert checks.rows[0]["ok"] is None and checks.passed
    checks.write()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["skipped_for_budget"] == ["slow"]
    checks = Checks(tmp_path, budget_s=100.0)
    step = checks.step(sleep, tmp_path / "b.log", cap_s=1)
    assert step.rc == 124 and step.hung and not step.budget_out
    checks.timed_out("hung", step, tmp_path / "b.log")
    assert checks.rows[0]["ok"] is False and not checks.passed


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent has not reaped it yet


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_timed_out_step_kills_its_whole_process_tree(tmp_path: Path) -> None:
    """A child that started two grandchildren, one in a session of its own (as torchrun starts
    its ranks), and hangs: on the timeout, all three are gone."""
    pids = tmp_path / "pids"
    child = textwrap.dedent(f"""
        import os, subprocess, sys, time
        hang = [sys.executable, "-c", "import time; time.sleep(300)"]
        plain = subprocess.Popen(hang)
        rank = subprocess.Popen(hang, start_new_session=True)
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{plain.pid}} {{rank.pid}}")
        time.sleep(300)
    """)
    started = time.monotonic()
    rc, _ = run_group([sys.executable, "-c", child], tmp_path / "c.log", timeout=3)
    assert rc == 124 and time.monotonic() - started < 60
    ids = [int(x) for x in pids.read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ids), ids


def _fake_cuda() -> tuple[ModuleType, list[str]]:
    cuda = ModuleType("fake_cuda")
    log: list[str] = []
    cuda.set_device = lambda device: log.append(f"set_device {device}")
    cuda.synchronize = lambda: log.append("synchronize")
    cuda.current_stream = lambda: log.append("current_stream")
    return cuda, log


def _in_thread(name: str, body) -> None:
    thread = threading.Thread(target=body, name=name)
    thread.start()
    thread.join()


def test_the_thread_recorder_catches_a_cuda_call_from_a_thread_without_the_device() -> None:
    cuda, log = _fake_cuda()
    recorder = CudaThreads(cuda, rank_device=1).install()
    cuda.set_device(1)
    cuda.synchronize()  # the main thread, its device set: fine

    def writer() -> None:  # DCP's staging thread as today: no set_device
        cuda.current_stream()

    def fixed_writer() -> None:  # the fix: the rank's device first
        cuda.set_device("cuda:1")
        cuda.synchronize()

    def wrong_device() -> None:
        cuda.set_device(0)
        cuda.current_stream()

    _in_thread("ckpt-writer", writer)
    _in_thread("fixed-writer", fixed_writer)
    _in_thread("wrong-device", wrong_device)
    recorder.uninstall()
    cuda.synchronize()  # not recorded any more
    report = recorder.report()
    unset = {(r["thread"], r["call"]) for r in report["unset"]}
    assert unset == {("ckpt-writer", "current_stream"), ("wrong-device", "current_stream")}
    assert set(report["other_threads"]) == {"ckpt-writer", "fixed-writer", "wrong-device"}
    assert sum(r["count"] for r in report["calls"]) == 4
    assert log.count("synchronize") == 3  # the wrapped functions still ran


def _call(op: str, members: tuple, shape: tuple, dtype: str = "torch.bfloat16", peer=-1) -> Call:
    return Call(op, members, peer, (shape,), (dtype,))


def test_the_cross_rank_comparison_catches_mismatched_collectives() -> None:
    tp = (0, 1)
    same = {r: [_call("allreduce_", tp, (4, 8)), _call("_allgather_base_", tp, (16,))] for r in tp}
    assert compare(same) == []
    shape = {**same, 1: [_call("allreduce_", tp, (4, 8)), _call("_allgather_base_", tp, (8,))]}
    assert any("call 1" in p and "rank 1" in p for p in compare(shape))
    dtype = {**same, 1: [_call("allreduce_", tp, (4, 8), "torch.float32"), same[1][1]]}
    assert any("call 0" in p for p in compare(dtype))
    missing = {**same, 1: same[1][:1]}
    assert any("issued 2 collectives, rank 1 1" in p for p in compare(missing))
    silent = {0: same[0], 1: []}  # a member that never joined the group's calls
    assert compare(silent)
    pp = (0, 4)
    send = _call("send", pp, (1, 32, 32), "torch.float32", peer=4)
    recv = _call("recv_", pp, (1, 32, 32), "torch.float32", peer=0)
    assert compare({0: [send], 4: [recv]}) == []
    bad_recv = _call("recv_", pp, (1, 32, 16), "torch.float32", peer=0)
    assert any("0 -> 4, call 0" in p for p in compare({0: [send], 4: [bad_recv]}))
    assert any("1 sends, 0 receives" in p for p in compare({0: [send], 4: []}))
    # What NCCL pairs is counts and dtypes: torch 2.11's stages greet with a 0-d send into a
    # 1-element receive; that is noted, not a mismatch. A reshaped collective likewise.
    notes: list[str] = []
    greet = _call("send", pp, (), "torch.float32", peer=4)
    into = _call("recv_", pp, (1,), "torch.float32", peer=0)
    assert compare({0: [greet], 4: [into]}, notes) == [] and len(notes) == 1
    flat = {0: [_call("allreduce_", tp, (32,))], 1: [_call("allreduce_", tp, (4, 8))]}
    assert compare(flat, notes) == [] and len(notes) == 2
    other_op = {0: [_call("allreduce_", tp, (32,))], 1: [_call("broadcast_", tp, (32,))]}
    assert compare(other_op)
