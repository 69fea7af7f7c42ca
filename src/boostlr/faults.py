"""Named faults, so tests can break a real rank at an exact moment.

``BOOSTLR_CRASH_AT="POINT[:STEP][@RANK]"`` kills the process with SIGKILL (no cleanup, no
atexit: what the OOM killer does) when it reaches ``crash_point(POINT)`` at that step on that
rank — only in a run's first attempt, so an automatic restart gets past it.

``BOOSTLR_SLOW_HASH="SECONDS_PER_MIB[@RANK]"`` makes checkpoint verification hash at that
pace (on that rank only, or on every rank): a tiny checkpoint then takes as long to verify
as a huge one on a slow file system, so collective timeouts around verification can be
tested without writing hundreds of gigabytes. ``BOOSTLR_SLOW_IO`` does the same to a save's
writes and a load's reads of checkpoint shards. Unset (always, outside tests) a fault point
costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "BOOSTLR_CRASH_AT"
SLOW_HASH_ENV = "BOOSTLR_SLOW_HASH"
SLOW_IO_ENV = "BOOSTLR_SLOW_IO"


def crash_point(name: str, rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    where, _, at_rank = spec.partition("@")
    point, _, at_step = where.partition(":")
    if point != name or (at_rank and int(at_rank) != rank) or (at_step and int(at_step) != step):
        return
    os.kill(os.getpid(), signal.SIGKILL)


def throttle_hash(nbytes: int) -> None:
    """Sleep as ``BOOSTLR_SLOW_HASH`` asks after hashing ``nbytes`` (the rank is ``RANK``)."""
    _throttle(SLOW_HASH_ENV, nbytes)


def throttle_io(nbytes: int) -> None:
    """Sleep as ``BOOSTLR_SLOW_IO`` asks after writing or reading ``nbytes`` of shards."""
    _throttle(SLOW_IO_ENV, nbytes)


def _throttle(env: str, nbytes: int) -> None:
    spec = os.environ.get(env)
    if not spec:
        return
    pace, _, at_rank = spec.partition("@")
    if at_rank and int(at_rank) != int(os.environ.get("RANK", "0")):
        return
    time.sleep(float(pace) * nbytes / (1 << 20))
