"""What parts of a model do around a training step, behind one interface the engine calls.

Some parts keep state beside their parameters that moves with the step rather than with
the gradient (the MoE routers' balance bias and routing statistics). Each such part is a
:class:`StepHook`; :class:`boostlr.parallel.engine.ParallelModel` calls every hook of the
model it runs, and the step loop calls only the engine, so it knows no architecture. A new
part with step bookkeeping is one hook class and one entry in :data:`BUILDERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from boostlr.config import RunConfig
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.moe_steps import MoESteps
from boostlr.parallel.tensor_parallel import TensorParallelModel


class StepHook(Protocol):
    """Bookkeeping of one kind of model part, on every rank, around each optimizer step."""

    def begin_step(self, logs: bool) -> None:
        """Before the step's first forward; ``logs``: this step writes a metrics row."""

    def after_optimizer_step(self) -> None:
        """After ``optimizer.step()``: state that follows the step (every rank alike)."""

    def log_metrics(self) -> dict[str, float | int]:
        """A log step's keys (on every rank: collectives allowed; the same on each)."""
        ...


#: ``(cfg, comms, stages, device, micro_batches) -> hook or None`` (``None``: the model has
#: no such part). ``micro_batches``: the loss pieces each step's gradient is summed over.
Builder = Callable[
    [RunConfig, MeshComms, list[TensorParallelModel], torch.device, int], StepHook | None
]
BUILDERS: tuple[Builder, ...] = (MoESteps.build,)


def step_hooks(
    cfg: RunConfig,
    comms: MeshComms,
    stages: list[TensorParallelModel],
    device: torch.device,
    micro_batches: int,
) -> list[StepHook]:
    """The hooks of the model whose ``stages`` this rank holds."""
    built = (build(cfg, comms, stages, device, micro_batches) for build in BUILDERS)
    return [hook for hook in built if hook is not None]
