"""``train.profile_steps A:B``: a torch.profiler trace of those steps in the run directory.

One Chrome/Perfetto JSON per rank (``trace_rank{r}_steps{A}-{B}.json``; open it in
https://ui.perfetto.dev or chrome://tracing). Blocks are labelled ``block.{i}``, BTP regions
``region.{tag}`` and collectives ``{group}.{op}.{tag}`` — the tags of the communication
ledger — so a region's compute and the all-reduce that ends it sit side by side.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import profile

from boostlr.config import profile_range
from boostlr.platform import platform_for


class StepProfiler:
    """Starts the profiler before step A and writes the trace after step B (or at the end)."""

    def __init__(self, spec: str, run_dir: Path, rank: int, device: torch.device):
        self.range = profile_range(spec)
        self.run_dir, self.rank, self.device = run_dir, rank, device
        self._prof: profile | None = None
        self.path: Path | None = None

    def before_step(self, step: int) -> None:
        if self.range is None or step != self.range[0]:
            return
        self._prof = profile(activities=platform_for(self.device).profiler_activities())
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is not None and self.range is not None and step >= self.range[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends before step B)."""
        if self._prof is None or self.range is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        a, b = self.range
        self.path = self.run_dir / f"trace_rank{self.rank}_steps{a}-{b}.json"
        prof.export_chrome_trace(str(self.path))
