"""Named crash points, so tests can SIGKILL a real rank at an exact moment.

``BOOSTLR_CRASH_AT="POINT[:STEP][@RANK]"`` kills the process with SIGKILL (no cleanup, no
atexit: what the OOM killer does) when it reaches ``crash_point(POINT)`` at that step on that
rank — only in a run's first attempt, so an automatic restart gets past it. Unset (always,
outside tests) a crash point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "BOOSTLR_CRASH_AT"


def crash_point(name: str, rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    where, _, at_rank = spec.partition("@")
    point, _, at_step = where.partition(":")
    if point != name or (at_rank and int(at_rank) != rank) or (at_step and int(at_step) != step):
        return
    os.kill(os.getpid(), signal.SIGKILL)
