"""Stopping early to be resumed: on a scheduler's signal, or before the job's time limit.

A cluster sends SIGTERM (or the signal chosen with ``sbatch --signal``) some time before it
kills a preempted or timed-out job. The handler installed here only records the signal; the
step loop asks :class:`StopCheck` at the end of every step whether any rank has one (or is
near the time limit), and all ranks then save that step and exit with
:data:`~boostlr.errors.EXIT_STOPPED`.

The ranks agree through one MAX all-reduce of a one-element *host* tensor per step on a gloo
group of their own: a CPU-to-CPU exchange that never waits on the device (the loop's quiet
steps stay free of host syncs), started at one step's end and read at the next one's (so its
latency hides behind a step), on its own group so that it never interleaves with an async
save's collectives on the checkpoint group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from boostlr.config.stopping import parse_duration, parse_signals
from boostlr.platform import HOST_BACKEND

TIME_LIMIT_CODE = 1000  # above every signal number: "the time limit is near"
_received: list[int] = []  # signal numbers, in order of arrival (a handler only appends)
_forwarding = [False]  # pass each signal on to this process's ranks (boostlr's launcher)
_delivered: set[int] = set()  # ranks the first signal was passed on to


def _record(signum: int, frame: FrameType | None) -> None:
    """Only remember the signal (a second one while saving changes nothing) and pass it on
    to the ranks this process started."""
    _received.append(signum)
    if _forwarding[0]:
        deliver()


def deliver() -> None:
    """Pass the first signal on to every rank that handles it and has not had it yet.

    A rank still starting up (before :func:`handling_signals`) would die of it, so it
    gets the signal once it catches it (``SigCgt`` in ``/proc/PID/status``): the
    forwarding thread of :func:`forward_to_children` asks again until the ranks end.
    """
    signum = received()
    if signum is None:
        return
    for pid in rank_children():
        if pid in _delivered or not _catches(pid, signum):
            continue
        try:
            os.kill(pid, signum)
            _delivered.add(pid)
        except ProcessLookupError:
            pass


def _catches(pid: int, signum: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def rank_children() -> list[int]:
    """This process's children that are ranks spawned by its launcher (multiprocessing's
    ``spawn_main``; not its resource tracker, which a SIGUSR1 would kill)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    ranks = []
    for pid in pids:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            continue
    return ranks


@contextmanager
def handling_signals(spec: str) -> Iterator[None]:
    """Record ``spec``'s signals instead of dying of them, for the duration (the previous
    handlers, and nothing received, afterwards: ``train()`` called as a library leaves the
    caller's process as it was). Outside the main thread Python cannot handle signals:
    nothing changes there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _record) for sig in parse_signals(spec)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()
        _delivered.clear()


def ignore_signals(spec: str) -> None:
    """Ignore ``spec``'s signals from now on: a process about to exit after its ranks saved
    (a later signal must not turn its exit code 75 into a death by that signal)."""
    if threading.current_thread() is threading.main_thread():
        for sig in parse_signals(spec):
            signal.signal(sig, signal.SIG_IGN)


def forward_to_children(on: bool) -> None:
    """Pass a recorded signal on to this process's ranks while it launches them."""
    _forwarding[0] = on
    if on:
        threading.Thread(target=_keep_delivering, daemon=True, name="boostlr-signals").start()


def _keep_delivering() -> None:
    while _forwarding[0]:
        if received() is not None:
            deliver()
        time.sleep(0.2)


def received() -> int | None:
    """The first save signal this process received, if any."""
    return _received[0] if _received else None


def reason(code: int) -> str:
    """What a stop code means, in words."""
    if code >= TIME_LIMIT_CODE:
        return "the time limit is near"
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def job_end_time(env: dict[str, str] | os._Environ) -> float | None:
    """SLURM's end time of this job (epoch seconds): ``SLURM_JOB_END_TIME`` where SLURM
    sets it (23.02 and newer), else ``squeue -h -j $SLURM_JOB_ID -o %e``; ``None`` outside
    SLURM, without a time limit, or when squeue cannot say."""
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp()  # local time, as squeue prints it
    except (OSError, ValueError, subprocess.SubprocessError):
        return None  # "N/A", "Unknown" or "INVALID": no end time to stop before


def process_start_time() -> float:
    """When this process started (epoch seconds; its start before any re-execution),
    from ``/proc``; now where there is none."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def deadline(time_limit: str, started: float, env: dict[str, str] | os._Environ) -> float | None:
    """When this process must have stopped (epoch seconds), or ``None``.

    ``auto``: the SLURM job's end time when under SLURM; a duration counts from
    ``started`` (this process's start: a requeued job gets the whole limit again).
    """
    limit = time_limit.strip().lower()
    if limit == "none":
        return None
    if limit == "auto":
        return job_end_time(env)
    return started + parse_duration(limit)


class StopCheck:
    """Whether the ranks stop after this step, decided alike on every rank.

    At the end of every step each rank puts its first signal (or :data:`TIME_LIMIT_CODE`
    when less than twice the save time plus two steps is left) into a one-element host
    tensor, whose MAX all-reduce over ``group`` (gloo) is started without waiting; the
    next step's check waits for it and returns it. Every rank thus reads the same value at
    the same step, one step after the signal (a bounded lag of one step), and the exchange
    runs in gloo's threads while that step computes, so at any scale its latency is hidden
    behind a step. ``group`` is ``None`` in one process, where the value is read directly.
    """

    def __init__(self, group: dist.ProcessGroup | None, end: float | None):
        self.group, self.end = group, end
        self._flag = torch.zeros(1, dtype=torch.int32)  # host memory: no device involved
        self._work: Any = None  # the all-reduce in flight, started by the previous check
        self._last = time.monotonic()
        self.step_s = 0.0

    def check(self, save_s: float) -> int:
        """0 to go on; else the stop code (a signal number or :data:`TIME_LIMIT_CODE`)."""
        now = time.monotonic()
        self.step_s, self._last = now - self._last, now
        code = received() or 0
        if self.end is not None and self.end - time.time() < 2 * (save_s + self.step_s):
            code = max(code, TIME_LIMIT_CODE)
        if self.group is None:
            return code
        agreed = 0
        if self._work is not None:
            self._work.wait()
            agreed = int(self._flag.numpy()[0])  # a host tensor: numpy reads it, nothing syncs
        self._flag.fill_(code)
        self._work = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return agreed

    def close(self) -> None:
        """Finish the exchange in flight (every rank started as many), then the group."""
        if self.group is None:
            return
        try:
            if self._work is not None:
                self._work.wait()
        except RuntimeError:
            pass  # a peer is gone: the error that ends this run says so, not this wait
        finally:
            dist.destroy_process_group(self.group)
            self.group = self._work = None


def stop_group(timeout_s: float) -> dist.ProcessGroup | None:
    """The gloo group of every rank the stop flag is all-reduced on (collective), or
    ``None`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend=HOST_BACKEND, timeout=timedelta(seconds=timeout_s))
