"""Progress bars for ``boostlr prepare``: one per phase, with throughput.

Every phase (scanning the input, feeding the BPE trainer, encoding) shows documents done of
the total, the UTF-8 text read so far, its rate in MB/s and, when encoding, tokens/s, so a
slow phase on a large corpus is visible as such. Bars go to stderr and vanish when done;
disabled, the meter still counts, so callers need no second code path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

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
        parts = [f"{n_bytes / MB:,.0f} MB"]
        if elapsed > 0:
            parts.append(f"{n_bytes / MB / elapsed:.1f} MB/s")
            if tokens:
                parts.append(f"{tokens / elapsed / 1e6:.2f}M tok/s")
        return Text("  ".join(parts))


@dataclass
class Meter:
    """What one phase has done; ``advance`` is called from one thread at a time."""

    docs: int = 0
    bytes: int = 0
    tokens: int = 0
    _bar: Progress | None = None
    _task: int | None = None

    def advance(self, docs: int = 0, n_bytes: int = 0, tokens: int = 0) -> None:
        self.docs += docs
        self.bytes += n_bytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(
                self._task, advance=docs, bytes=self.bytes, tokens=self.tokens, refresh=False
            )


@contextlib.contextmanager
def phase(enabled: bool, name: str, total_docs: int | None) -> Iterator[Meter]:
    """A bar for one phase (when ``enabled``), yielding its :class:`Meter`."""
    if not enabled:
        yield Meter()
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
        task = bar.add_task(name, total=total_docs, bytes=0, tokens=0)
        yield Meter(_bar=bar, _task=task)
