"""Named faults, so tests can break a real rank at an exact moment.

``BOOSTLR_CRASH_AT="POINT[:STEP][@RANK]"`` kills the process with SIGKILL (no cleanup, no
atexit: what the OOM killer does) when it reaches ``crash_point(POINT)`` at that step on that
rank — only in a run's first attempt, so an automatic restart gets past it.

``BOOSTLR_SIGNAL_AT="POINT[:STEP][@RANK][>parent]"`` (several, comma-separated) sends a real
SIGTERM there instead, to the rank itself or to its parent (boostlr's launcher, torchrun's
agent), once per process: a scheduler's signal arriving at an exact moment.

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
SIGNAL_ENV = "BOOSTLR_SIGNAL_AT"
_signalled: set[str] = set()
SLOW_HASH_ENV = "BOOSTLR_SLOW_HASH"
SLOW_IO_ENV = "BOOSTLR_SLOW_IO"


def crash_point(name: str, rank: int, step: int) -> None:
    signals = os.environ.get(SIGNAL_ENV)
    if signals:
        _signal_point(signals, name, rank, step)
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if _matches(spec, name, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _matches(spec: str, name: str, rank: int, step: int) -> bool:
    where, _, at_rank = spec.partition("@")
    point, _, at_step = where.partition(":")
    return not (
        point != name or (at_rank and int(at_rank) != rank) or (at_step and int(at_step) != step)
    )


def _signal_point(specs: str, name: str, rank: int, step: int) -> None:
    for spec in specs.split(","):
        where, _, target = spec.partition(">")
        if where in _signalled or not _matches(where, name, rank, step):
            continue
        _signalled.add(where)
        os.kill(os.getppid() if target == "parent" else os.getpid(), signal.SIGTERM)


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
