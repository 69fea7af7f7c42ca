"""``metrics.jsonl`` writing and the rank-0 console progress bar."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from boostlr.errors import BoostlrError
from boostlr.fsutil import write_text_atomic
from boostlr.train.sinks import MetricsSink


class MetricsLog:
    """Append-only JSON lines, flushed per row so a crash loses nothing already logged.

    ``sinks`` (TensorBoard, W&B) get a copy of every row after it is in the file.
    """

    def __init__(self, path: Path, sinks: Sequence[MetricsSink] = ()):
        self.path = path
        self.sinks = list(sinks)
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(_finite_or_str(row)) + "\n")
        self._fh.flush()
        for sink in self.sinks:
            sink.write(row)

    def close(self, ok: bool = True) -> None:
        """``ok=False``: the run is ending by an exception (the sinks may record it failed)."""
        self._fh.close()
        for sink in self.sinks:
            sink.close(ok)


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a resumed run re-does those steps), atomically.

    A crash in the middle of :meth:`MetricsLog.write` leaves a cut-off last line; that row
    belongs to a step after the checkpoint anyway, so it is dropped like the other later rows.
    An unreadable line before the last one is not a crash artefact and is reported.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    kept = []
    for index, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        row = _parse_row(line)
        if row is None:
            if index == last:
                break  # half-written by a crash
            raise BoostlrError(
                f"{path}:{index + 1} is not a JSON object (a damaged metrics log): fix or "
                "delete that line, then resume"
            )
        if row.get("step", 0) <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def _parse_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _finite_or_str(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf; keep such values readable as strings instead of invalid JSON."""
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }


def format_stats(row: dict[str, Any]) -> str:
    """Loss, lr, throughput, MFU (when the device's peak is known) and peak memory."""
    stats = f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s"
    if "mfu" in row:
        stats += f"  MFU {100 * row['mfu']:.1f}%"
    if "peak_mem_mb" in row:
        stats += f"  mem {row['peak_mem_mb']:,.0f} MB"
        if "mem_floor_mb" in row:
            stats += f" / floor {row['mem_floor_mb']:,.0f}"
    return stats


class ConsoleProgress:
    """A rich progress bar on a terminal; plain log lines when output is piped (CI, files)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.console = Console(stderr=False)
        self.enabled = enabled
        self.interactive = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, stats=""
            )
            self._progress.start()

    def print(self, message: str) -> None:
        # soft_wrap: a log line stays one line (piped, rich would break it at 80 columns).
        if self.enabled:
            self.console.print(message, highlight=False, soft_wrap=True)

    def update(self, step: int, row: dict[str, Any] | None) -> None:
        stats = None
        if row is not None:
            stats = format_stats(row)
        if self._progress is not None:
            kwargs = {"completed": step}
            if stats:
                kwargs["stats"] = stats
            self._progress.update(self._task, **kwargs)
        elif self.enabled and stats:
            self.console.print(f"step {step:>6}  {stats}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
