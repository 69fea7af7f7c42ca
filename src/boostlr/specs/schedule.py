"""What each pipeline schedule is: the torch class that runs it and the facts around it.

:mod:`boostlr.parallel.pipeline` builds the named ``torch.distributed.pipelining`` class;
validation reads the micro-batch constraints, the memory model the micro-batches a rank holds
at once, and the cost model how a step is timed. A new schedule is one :class:`ScheduleSpec`
here (plus, to be simulated, a program in :mod:`boostlr.analysis.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from boostlr.specs.table import lookup

# How the cost model times a schedule's step (``analysis/schedule.py`` dispatches on these):
# the first two are per-rank programs it simulates, the last a closed form.
FORWARDS_FIRST = "forwards-first"  # every forward, then every backward
ONE_FORWARD_ONE_BACKWARD = "one-forward-one-backward"  # warm-up, steady 1F1B, drain
VIRTUAL_SLOTS = "virtual-slots"  # Megatron's ``m*v + p - 1`` slots of one virtual stage


def _every_microbatch(microbatches: int, pp: int, rank: int, virtual: int) -> float:
    return float(microbatches)


def _warmup_depth(microbatches: int, pp: int, rank: int, virtual: int) -> float:
    return float(min(microbatches, pp - rank))


def _interleaved_depth(microbatches: int, pp: int, rank: int, virtual: int) -> float:
    # The first rank holds ``pp`` micro-batches of each of its stages plus ``pp - 1`` of
    # warm-up (Megatron's count), spread over its ``virtual`` stages.
    return float(min(microbatches * virtual, pp * virtual + pp - 1 - 2 * rank)) / virtual


def _never(microbatches: int, pp: int, rank: int) -> bool:
    return False


def _past_warmup(microbatches: int, pp: int, rank: int) -> bool:
    return microbatches > pp - rank


def _always(microbatches: int, pp: int, rank: int) -> bool:
    return True


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule's facts.

    ``torch_class``: the ``torch.distributed.pipelining`` class that runs it, by name (the
    specs import no torch). ``multi_stage``: each rank runs ``pp_virtual`` stages (a
    ``PipelineScheduleMulti``, handed the list of its stages), not one.
    ``microbatches_at_least_pp`` / ``microbatches_multiple_of_pp``: what torch refuses
    otherwise. ``in_flight``: ``(microbatches, pp, rank, virtual)`` -> the micro-batches
    whose activations one rank holds at once, per stage it runs. ``grads_before_peak``:
    ``(microbatches, pp, rank)`` -> whether a backward (and so the step's gradients) comes
    before the rank's activations peak. ``timing``: how the cost model spans a step.
    """

    name: str
    torch_class: str
    timing: str
    in_flight: Callable[[int, int, int, int], float]
    grads_before_peak: Callable[[int, int, int], bool]
    multi_stage: bool = False
    microbatches_at_least_pp: bool = False
    microbatches_multiple_of_pp: bool = False

    def stages_per_rank(self, pp_virtual: int) -> int:
        return pp_virtual if self.multi_stage else 1


GPIPE = ScheduleSpec(
    "gpipe",
    "ScheduleGPipe",
    FORWARDS_FIRST,
    in_flight=_every_microbatch,  # every forward runs before the first backward
    grads_before_peak=_never,
)
ONE_F_ONE_B = ScheduleSpec(
    "1f1b",
    "Schedule1F1B",
    ONE_FORWARD_ONE_BACKWARD,
    in_flight=_warmup_depth,
    grads_before_peak=_past_warmup,  # its steady state runs a forward after a backward
    microbatches_at_least_pp=True,
)
INTERLEAVED = ScheduleSpec(
    "interleaved",
    "ScheduleInterleaved1F1B",
    VIRTUAL_SLOTS,
    in_flight=_interleaved_depth,
    grads_before_peak=_always,
    multi_stage=True,
    microbatches_at_least_pp=True,
    microbatches_multiple_of_pp=True,
)

#: In the schema's ``PPSchedule`` order (the planner tries them so).
SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED)}
#: The schema's default, and what the planner records where there is no pipeline.
DEFAULT_SCHEDULE = ONE_F_ONE_B


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(SCHEDULES, name, "pipeline schedule")
