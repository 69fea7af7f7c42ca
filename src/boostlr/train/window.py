"""The steps between two log rows, measured without waiting for the device in between.

The loss, the gradient norm and a "first non-finite step" marker stay device tensors while
the window runs; :meth:`Window.check` reads them (one host sync) on a log step or before a
save, so the divergence error names the window in which it happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from boostlr.errors import TrainingDiverged
from boostlr.parallel.ledger import CommLedger
from boostlr.platform import platform_for
from boostlr.rundir.checkpoint import newest_checkpoint
from boostlr.rundir.layout import checkpoints_dir
from boostlr.train.state import RunState


@dataclass
class Window:
    """The steps since the last log row; what they measured is read from the device once."""

    device: torch.device
    first: int
    started: float = field(default_factory=time.perf_counter)
    excluded: float = 0.0  # seconds of evaluation and saves inside the window
    steps: int = 0
    comm: dict[str, float] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    first_bad: torch.Tensor | None = None  # the first step with a non-finite loss/norm, or 0

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.steps += 1
        self.loss, self.grad_norm = loss, grad_norm
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))
        bad = torch.where(finite, 0, step)
        seen = self.first_bad
        self.first_bad = bad if seen is None else torch.where(seen > 0, seen, bad)

    def take_comm(self, ledger: CommLedger) -> None:
        """Move the ledger's blocked time into the window (a sync on CUDA)."""
        for group, seconds in ledger.take_seconds().items():
            self.comm[group] = self.comm.get(group, 0.0) + seconds

    def check(self, state: RunState, step: int) -> tuple[float, float]:
        """(loss, grad norm) of the last step; raises if any step's was NaN/inf."""
        assert self.loss is not None and self.grad_norm is not None and self.first_bad is not None
        loss, norm, bad = float(self.loss), float(self.grad_norm), int(self.first_bad)
        if bad:
            state.writer.wait()
            kept = newest_checkpoint(checkpoints_dir(state.run_dir))
            raise TrainingDiverged(
                f"loss / grad norm at step {bad} is not finite (steps {self.first}-{step}, "
                f"checked at step {step}; last: loss {loss}, grad norm {norm}): stopped "
                f"without saving (last good checkpoint: {kept.path if kept else 'none'}); "
                "lower --train.lr or use --train.dtype float32, then --resume"
            )
        return loss, norm

    def seconds_per_step(self) -> float:
        platform_for(self.device).synchronize(self.device)
        elapsed = time.perf_counter() - self.started - self.excluded
        return elapsed / max(1, self.steps)
