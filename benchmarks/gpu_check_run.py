"""The bookkeeping of ``benchmarks/gpu_check.py``: checks with outcomes, a shared time budget,
and steps run as process groups that a timeout kills whole.

A check is ``ok`` (true), ``FAIL`` (false) or skipped (``None``, its detail saying why). A
step stopped because the budget ran out is *skipped (budget)*: it says nothing about the code.
A step that outlives its own cap while budget is left is a failure (a hang). Each step runs in
a session of its own (``start_new_session``); on a timeout its process group and those of all
its descendants (torchrun puts each rank in a session of its own) are killed, and once it ends
whatever it left in its group: a hung rank or a compile worker cannot hold the GPU into the
next check.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

CUBLAS_DETERMINISTIC = ":4096:8"
# Caps per step (seconds; each also stops where the budget does): past its cap with budget
# left, a step is reported as hung.
CAPS = {"train": 330, "resume": 240, "collectives": 240, "export": 90, "eval": 120}


def use_own_tree() -> None:
    """This tree's ``src`` first, for this process and (through ``PYTHONPATH``) every step."""
    if str(SRC) not in sys.path[:1]:
        sys.path.insert(0, str(SRC))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), *(p for p in parts if p != str(SRC))])


def step_env(deterministic: bool) -> dict[str, str]:
    """The steps' environment: this tree's ``src`` first; cuBLAS's deterministic workspace."""
    env = dict(os.environ)
    if deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    return env


BUDGET = "skipped (budget)"
GRACE_S = 5.0  # between SIGTERM and SIGKILL of a timed-out group


@dataclass
class Step:
    """How a step ended: its exit code (124 on a timeout), seconds, and why it stopped."""

    rc: int
    seconds: float
    budget_out: bool = False  # stopped because the budget ran out, not at its own cap
    hung: bool = False  # stopped at its own cap with budget left


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, grace_s: float = GRACE_S, reap: Callable[[], Any] = lambda: None) -> None:
    """SIGTERM the process group of ``pid`` and those of all its descendants, then SIGKILL
    what is left after ``grace_s``.

    The descendants' groups matter: torchrun starts each rank in a session of its own, so a
    rank is not in torchrun's group. ``reap`` (the leader's ``Popen.poll``) keeps a dead
    leader from lingering as a zombie member of its group while we wait."""
    below = descendants(pid)
    groups = {pid}
    for p in below:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never our own

    def signal_all(sig: int) -> bool:
        """Send ``sig`` (0: only ask) to every group and process; whether any was there."""
        there = False
        for send, target in [(os.killpg, g) for g in groups] + [(os.kill, p) for p in below]:
            try:
                send(target, sig)
                there = True
            except (ProcessLookupError, PermissionError):
                pass
        return there

    if not signal_all(signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap()
        if not signal_all(0):
            return
        time.sleep(0.05)
    signal_all(signal.SIGKILL)


def run_group(
    cmd: list[str], log: Path, timeout: float, env: dict | None = None, cwd: Path | None = None
) -> tuple[int, float]:
    """Run ``cmd`` in a new session with its output in ``log``; (exit code, seconds).

    On a timeout (exit code 124) its whole process tree is killed, group by group; once the
    command ends, so is anything it left behind in its group."""
    started = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            rc = 124
        finally:  # also on Ctrl-C: the group goes down with us
            kill_tree(proc.pid, GRACE_S if proc.poll() is None else 0.5, proc.poll)
            proc.wait()
    return rc, time.monotonic() - started


class Checks:
    """The checks so far, each with its outcome, a detail line and its seconds."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.facts: dict[str, Any] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def add(self, name: str, ok: bool | None, detail: str, seconds: float = 0.0) -> bool:
        self.rows.append({"check": name, "ok": ok, "detail": detail, "seconds": seconds})
        mark = {True: "ok", False: "FAIL", None: "skip"}[ok]
        print(f"[{mark:>4}] {name}: {detail}", flush=True)
        return bool(ok)

    def skip_budget(self, name: str, why: str = "") -> bool:
        return self.add(name, None, f"{BUDGET}: {why or f'{max(self.left(), 0):.0f} s left'}")

    def step(
        self,
        cmd: list[str],
        log: Path,
        cap_s: float,
        env: dict | None = None,
        cwd: Path | None = None,
    ) -> Step:
        """Run one step under ``min(cap_s, budget left)``; a timeout says which one hit."""
        left = self.left()
        if left <= 0:  # not started at all
            log.write_text("$ " + " ".join(cmd) + "\nnot started: the budget is spent\n")
            return Step(124, 0.0, budget_out=True)
        rc, seconds = run_group(cmd, log, min(cap_s, left), env, cwd)
        if rc != 124:
            return Step(rc, seconds)
        return Step(rc, seconds, budget_out=left <= cap_s, hung=left > cap_s)

    def timed_out(self, name: str, step: Step, log: Path) -> None:
        """Record a step that timed out: skipped for the budget, or a failure (a hang)."""
        if step.budget_out:
            self.skip_budget(name, f"the budget ran out after {step.seconds:.0f} s of it")
        else:
            self.add(name, False, f"timed out after {step.seconds:.0f} s: {tail(log)}")

    @property
    def passed(self) -> bool:
        return all(r["ok"] is not False for r in self.rows)

    def write(self) -> None:
        report = {
            "passed": self.passed,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "budget_s": self.budget_s,
            "skipped_for_budget": [r["check"] for r in self.rows if r["detail"].startswith(BUDGET)],
            "checks": self.rows,
            **self.facts,
        }
        (self.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        lines = ["| check | result | seconds | detail |", "|---|---|---|---|"]
        for r in self.rows:
            mark = {True: "ok", False: "FAIL", None: "skipped"}[r["ok"]]
            lines.append(f"| {r['check']} | {mark} | {r['seconds']:.1f} | {r['detail']} |")
        lines.append(f"\n{'PASSED' if self.passed else 'FAILED'} in {report['elapsed_s']} s")
        table = "\n".join(lines)
        (self.out / "gpu_check.md").write_text(table + "\n")
        print("\n" + table)


def tail(log: Path, n: int = 3) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return " / ".join(lines[-n:])[-400:]


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
