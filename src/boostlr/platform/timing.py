"""Timers of regions of a step: wall time where the host blocks, device events where it only
queues work. Device-independent: a platform picks which one (and makes the events)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class WallTimer:
    """Seconds per key of regions that block the host (gloo's calls do): wall time."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add(key, time.perf_counter() - started)

    def _add(self, key: str, seconds: float) -> None:
        self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """Seconds per key since the last call; starts anew."""
        seconds, self._seconds = self._seconds, {}
        return seconds


class EventTimer(WallTimer):
    """Seconds per key of regions on the device's stream, timed by a reused pool of events.

    The host only queues work, so each region records a start and an end event on the
    current stream. Once ``harvest_at`` pairs are pending, each region reads the oldest
    pairs whose end has passed (``query``, never a wait) and stops at the first that has
    not: regions end in stream order, so the newer ones have not either. A region then
    costs one query plus the pairs it reads (each read once), however far the device lags,
    and the pool holds the events of the work still in flight; :meth:`take` waits for the
    rest (a host sync, for log steps).

    ``make_event`` makes one timing event of the device (the platform knows its kind); an
    event needs ``record``, ``query``, ``synchronize`` and ``elapsed_time`` in milliseconds.
    """

    def __init__(self, make_event: Callable[[], Any], harvest_at: int = 64):
        super().__init__()
        self._make = make_event
        self.harvest_at = harvest_at
        self._free: list[Any] = []
        self._pending: deque[tuple[str, Any, Any]] = deque()
        self.created = 0  # events made so far: the pool's size

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        self.created += 1
        return self._make()

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = self._event()
        start.record()
        try:
            yield
        finally:
            end = self._event()
            end.record()
            self._pending.append((key, start, end))
            if len(self._pending) >= self.harvest_at:
                self._harvest_finished()

    def _harvest_finished(self) -> None:
        """Read the oldest pairs while their end has passed."""
        while self._pending and self._pending[0][2].query():
            self._read(*self._pending.popleft())

    def _read(self, key: str, start: Any, end: Any) -> None:
        self._add(key, start.elapsed_time(end) / 1e3)
        self._free += [start, end]

    def take(self) -> dict[str, float]:
        while self._pending:
            key, start, end = self._pending.popleft()
            end.synchronize()
            self._read(key, start, end)
        return super().take()
