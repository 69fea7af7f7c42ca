"""A checkpoint save inside the step loop: the state checked finite first, the save's time
and collectives kept out of the step window, its cost written as a metrics row."""

from __future__ import annotations

import time

from boostlr.train.memory import MemoryPhases
from boostlr.train.metrics import MetricsLog
from boostlr.train.state import RunState, save
from boostlr.train.window import Window


def save_in_loop(
    state: RunState,
    step: int,
    window: Window,
    phases: MemoryPhases,
    metrics: MetricsLog | None,
    row: dict | None,
) -> None:
    """Save ``step`` (checked finite first) and log what it cost; its time is not the step's."""
    if row is None:  # never save a state that went non-finite
        window.check(state, step)
    ledger = state.model.comms.ledger
    paused = time.perf_counter()
    window.take_comm(ledger)
    cost = save(state, step)
    phases.mark("save")
    ledger.take_seconds()  # the save's own time is not the step's
    window.excluded += time.perf_counter() - paused
    if metrics is not None:
        metrics.write({"step": step, **cost.row(), "async": state.cfg.train.async_ckpt})
