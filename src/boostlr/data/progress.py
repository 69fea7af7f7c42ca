"""Progress bars for ``boostlr prepare``: one per phase, with throughput, and its cores used.

Every phase (scanning the input, feeding the BPE trainer, its merges, encoding) shows
documents done of the total, the UTF-8 text read so far, its rate in MB/s and, when
encoding, tokens/s, so a slow phase on a large corpus is visible as such. Bars go to stderr
and vanish when done; disabled, the meter still counts, so callers need no second code path.
Each phase also records its wall time and the process's CPU time (all threads, the
tokenizers library's Rust threads included): their ratio is the cores it kept busy, the
number that says whether a phase is parallel.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

MB = 1e6


class _Throughput(ProgressColumn):
    """``312 MB  5.1 MB/s  1.2M tok/s`` from the task's byte and token fields."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        n_bytes, tokens = task.fields.get("bytes", 0), task.fields.get("tokens", 0)
        if not n_bytes:  # a phase that reads no text (the BPE merges)
            return Text("")
        parts = [f"{n_bytes / MB:,.0f} MB"]
        if elapsed > 0:
            parts.append(f"{n_bytes / MB / elapsed:.1f} MB/s")
            if tokens:
                parts.append(f"{tokens / elapsed / 1e6:.2f}M tok/s")
        return Text("  ".join(parts))


@dataclass
class Meter:
    """What one phase has done; ``advance`` is called from one thread at a time.

    ``wall_s`` and ``cpu_s`` are set when the phase ends. ``stage_cpu_s`` holds the CPU
    seconds of named threads inside the phase (the encoder's reader and writer), so a
    pipeline's stages can be told apart although they overlap in time.
    """

    name: str = ""
    docs: int = 0
    bytes: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    stage_cpu_s: dict[str, float] = field(default_factory=dict)
    _bar: Progress | None = None
    _task: int | None = None

    @property
    def cores(self) -> float:
        """Cores kept busy on average: process CPU time over wall time."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def stats(self) -> dict[str, Any]:
        """The phase as a JSON-ready record (``--stats``, benchmarks)."""
        stages = dict(self.stage_cpu_s)
        if stages:  # the rest of the phase's CPU ran in the tokenizer's own threads
            stages["tokenise"] = max(0.0, self.cpu_s - sum(stages.values()))
        return {
            "phase": self.name,
            "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "cores": round(self.cores, 2),
            "docs": self.docs,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "stage_cores": {k: round(v / self.wall_s, 2) for k, v in stages.items()}
            if self.wall_s > 0
            else {},
        }

    def advance(self, docs: int = 0, n_bytes: int = 0, tokens: int = 0) -> None:
        self.docs += docs
        self.bytes += n_bytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(
                self._task, advance=docs, bytes=self.bytes, tokens=self.tokens, refresh=False
            )


@contextlib.contextmanager
def phase(
    enabled: bool, name: str, total_docs: int | None, log: list[Meter] | None = None
) -> Iterator[Meter]:
    """A bar for one phase (when ``enabled``), yielding its timed :class:`Meter`.

    The meter is appended to ``log`` when the phase ends (also on an error).
    """
    wall, cpu = time.perf_counter(), time.process_time()
    meter = Meter(name=name)
    try:
        with _bar(enabled, name, total_docs, meter):
            yield meter
    finally:
        meter.wall_s = time.perf_counter() - wall
        meter.cpu_s = time.process_time() - cpu
        if log is not None:
            log.append(meter)


@contextlib.contextmanager
def _bar(enabled: bool, name: str, total_docs: int | None, meter: Meter) -> Iterator[None]:
    if not enabled:
        yield
        return
    bar = Progress(
        TextColumn(f"[bold]{name:<9}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("docs"),
        _Throughput(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        meter._bar, meter._task = bar, bar.add_task(name, total=total_docs, bytes=0, tokens=0)
        try:
            yield
        finally:
            meter._bar = None


def summary(phases: list[Meter]) -> str:
    """One line: each phase's wall time and cores used (and its stages' cores, if any)."""
    parts = []
    for meter in phases:
        text = f"{meter.name} {meter.wall_s:.1f} s on {meter.cores:.2f} cores"
        stages = meter.stats()["stage_cores"]
        if stages:
            text += " (" + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) + ")"
        parts.append(text)
    return "; ".join(parts)
