"""The communication ledger: every collective a rank issues, with its payload and phase.

Per-step totals of it are the ``comm_*`` metrics, and the cost model's byte formulas
(``analysis/comm.py``) are tested against it record for record; timing what the rank waits
on lives here too, so a step's communication time and bytes come from one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from boostlr.platform import WallTimer, platform_for

Phase = Literal["fwd", "bwd", "recompute"]
OpName = Literal["all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all"]

PHASES: tuple[Phase, ...] = ("fwd", "bwd", "recompute")
OPS: tuple[OpName, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all")


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by one rank; ``bytes`` is that rank's payload."""

    op: str
    group: str
    phase: str
    bytes: int
    elements: int
    tag: str


@dataclass(eq=False)
class CommLedger:
    """Append-only log of collective calls, reset once per training step.

    The phase of a forward-direction collective is ``fwd`` unless it runs inside
    :meth:`recompute`, which is how activation checkpointing's re-forward is told
    apart: low-rank checkpointing must show zero recompute bytes, block
    checkpointing under vanilla/Megatron TP re-issues every forward all-reduce.
    """

    records: list[CommRecord] = field(default_factory=list)
    _recompute_depth: int = field(default=0, init=False, repr=False)
    _timer: WallTimer | None = field(default=None, init=False, repr=False)

    def record(
        self, op: str, group: str, phase: str, bytes: int, elements: int, tag: str = ""
    ) -> CommRecord:
        if op not in OPS:
            raise ValueError(f"unknown collective op {op!r}; expected one of {OPS}")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        rec = CommRecord(op, group, phase, int(bytes), int(elements), tag)
        self.records.append(rec)
        return rec

    def reset(self) -> None:
        """Start a new step's records. The time blocked keeps adding up until
        :meth:`take_seconds` (on a GPU the last regions are read only then: a host sync)."""
        self.records.clear()

    @contextmanager
    def timed(self, group: str, device: torch.device) -> Iterator[None]:
        """Measure the time this rank is blocked by the collective (or wait) inside.

        CPU backends (gloo) block the host for the whole call: wall time. On a GPU the host
        only enqueues; events on the current stream measure how long the stream stalls on
        the communication (a synchronous NCCL call makes it wait on the NCCL stream). The
        device module chooses (:meth:`~boostlr.platform.Platform.region_timer`).
        """
        if self._timer is None:
            self._timer = platform_for(device).region_timer()
        with self._timer.timed(group):
            yield

    def take_seconds(self) -> dict[str, float]:
        """Seconds blocked in collectives since the last call, per group name; starts anew."""
        return {} if self._timer is None else self._timer.take()

    @property
    def forward_phase(self) -> Phase:
        """Phase to stamp on a forward-direction collective issued right now."""
        return "recompute" if self._recompute_depth > 0 else "fwd"

    @contextmanager
    def recompute(self) -> Iterator[None]:
        """Mark forward-direction collectives issued inside as ``recompute``.

        Meant as the recompute half of ``torch.utils.checkpoint``'s ``context_fn``:
        ``context_fn=lambda: (nullcontext(), ledger.recompute())``.
        """
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1

    def totals(self, group: str | None = None) -> dict[str, int]:
        """Calls, elements and bytes (also bytes per phase), optionally for one group."""
        out = {"calls": 0, "elements": 0, "bytes": 0} | {f"bytes_{p}": 0 for p in PHASES}
        for rec in self.records:
            if group is not None and rec.group != group:
                continue
            out["calls"] += 1
            out["elements"] += rec.elements
            out["bytes"] += rec.bytes
            out[f"bytes_{rec.phase}"] += rec.bytes
        return out

    def step_metrics(self, prefix: str = "comm_tp", group: str | None = "tp") -> dict[str, int]:
        """The per-step metrics-log entries for one group (zeros when nothing ran)."""
        t = self.totals(group)
        keys = ("bytes", "calls", "bytes_fwd", "bytes_bwd", "bytes_recompute")
        return {f"{prefix}_{k}": t[k] for k in keys}
