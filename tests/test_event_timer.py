"""The event timer's work per timed collective stays constant however far the device lags.

A GPU rank times every collective with a pair of CUDA events and reads them back without
waiting. When the device runs far behind the host, thousands of pairs are pending; asking
each of them on every collective would make the host's cost per collective grow with the
lag. The events here are stand-ins for CUDA's (on a simulated stream that completes in
order); the timer is the real one.
"""

from __future__ import annotations

import pytest

from boostlr.platform import EventTimer


class _CountingEvent:
    """An event on a simulated stream: the ``n``-th recorded is complete once ``done`` > n."""

    stream = {"recorded": 0, "done": 0, "queries": 0}

    def record(self) -> None:
        self.at = self.stream["recorded"]
        self.stream["recorded"] += 1

    def query(self) -> bool:
        self.stream["queries"] += 1
        return self.at < self.stream["done"]

    def synchronize(self) -> None:
        self.stream["done"] = max(self.stream["done"], self.at + 1)

    def elapsed_time(self, end: _CountingEvent) -> float:
        assert self.at < self.stream["done"] and end.at < self.stream["done"]
        return (end.at - self.at) * 1e3  # one simulated second per event, in milliseconds


@pytest.fixture
def stream() -> dict[str, int]:
    _CountingEvent.stream.update(recorded=0, done=0, queries=0)
    return _CountingEvent.stream


def test_a_stalled_device_costs_one_query_per_collective(stream: dict[str, int]) -> None:
    timer = EventTimer(_CountingEvent, harvest_at=8)
    per_collective = []
    for _ in range(400):  # the device finishes nothing: 400 pairs pending at the end
        before = stream["queries"]
        with timer.timed("tp"):
            pass
        per_collective.append(stream["queries"] - before)
    assert max(per_collective) <= 1, per_collective[-10:]
    assert timer.take() == {"tp": pytest.approx(400.0)}  # every pair read once, in the end


def test_a_device_catching_up_is_read_at_constant_cost_per_collective(
    stream: dict[str, int],
) -> None:
    timer = EventTimer(_CountingEvent, harvest_at=8)
    for i in range(1000):
        with timer.timed("dp" if i % 2 else "tp"):
            pass
        if i % 50 == 49:  # the device catches up in bursts
            stream["done"] = stream["recorded"]
    # Each pair is asked about once when read, plus one "not yet" per collective at most.
    assert stream["queries"] <= 2 * 1000
    assert timer.created <= 2 * 60  # the pool: the pairs of work in flight, then reused
    assert timer.take() == {"tp": pytest.approx(500.0), "dp": pytest.approx(500.0)}
    assert timer.take() == {}
