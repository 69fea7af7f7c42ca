"""The pipeline schedule specs agree with everything that states the same facts elsewhere:
the schema's ``PPSchedule`` set and default, torch's schedule classes, validation, the
schema's stages per rank, and the programs the cost model simulates."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from boostlr.analysis.memory import grads_held_at_activation_peak, in_flight
from boostlr.analysis.schedule import PROGRAMS, program
from boostlr.config import PP_SCHEDULES, ModelConfig, ParallelConfig, resolve_model
from boostlr.config.validate import validate_parallel
from boostlr.errors import ConfigError
from boostlr.specs import schedule as schedule_specs
from boostlr.specs.schedule import DEFAULT_SCHEDULE, SCHEDULES, VIRTUAL_SLOTS, schedule_spec

SPEC_FILE = Path(schedule_specs.__file__)


def test_the_schema_set_and_default_are_the_specs() -> None:
    assert PP_SCHEDULES == tuple(SCHEDULES)  # same order: the planner tries them so
    assert ParallelConfig().pp_schedule == DEFAULT_SCHEDULE.name
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved"):
        schedule_spec("zero-bubble")


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_spec_names_a_torch_schedule_of_its_kind(name: str) -> None:
    spec = schedule_spec(name)
    cls = getattr(pipelining, spec.torch_class)
    kind = PipelineScheduleMulti if spec.multi_stage else PipelineScheduleSingle
    assert issubclass(cls, kind), (name, cls)


def test_the_specs_import_no_torch() -> None:
    """The config package reads them before anything imports torch."""
    for node in ast.walk(ast.parse(SPEC_FILE.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("torch"), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("torch") for a in node.names)


@pytest.mark.parametrize(("name", "pp", "virtual"), itertools.product(SCHEDULES, (1, 2, 4), (1, 2)))
def test_the_schema_stages_per_rank_are_the_specs(name: str, pp: int, virtual: int) -> None:
    p = ParallelConfig(pp=pp, pp_schedule=name, pp_virtual=virtual)
    want = schedule_spec(name).stages_per_rank(virtual) if pp > 1 else 1
    assert p.virtual_stages == want


def _model(n_layers: int) -> ModelConfig:
    return dataclasses.replace(resolve_model(ModelConfig(preset="tiny")), n_layers=n_layers)


@pytest.mark.parametrize(("name", "pp", "mb"), itertools.product(SCHEDULES, (2, 4), range(1, 10)))
def test_validation_refuses_what_the_spec_refuses(name: str, pp: int, mb: int) -> None:
    spec = schedule_spec(name)
    p = ParallelConfig(pp=pp, pp_schedule=name, microbatches=mb, pp_virtual=2)
    m = _model(16)
    if spec.microbatches_at_least_pp and mb < pp:
        with pytest.raises(ConfigError, match="at least as many micro-batches") as err:
            validate_parallel(p, m)
        assert str(err.value).endswith("or use --parallel.pp_schedule gpipe")
    elif spec.microbatches_multiple_of_pp and mb % pp:
        with pytest.raises(ConfigError, match=f"to be a multiple of parallel.pp \\({pp}\\)"):
            validate_parallel(p, m)
    else:
        validate_parallel(p, m)


def test_every_timing_is_simulated_or_slotted() -> None:
    for spec in SCHEDULES.values():
        assert spec.timing in PROGRAMS or spec.timing == VIRTUAL_SLOTS, spec
        assert (spec.timing == VIRTUAL_SLOTS) == spec.multi_stage, spec


def _held(name: str, rank: int, stages: int, microbatches: int) -> tuple[int, bool]:
    """The most forwards a rank's simulated program holds before their backwards, and
    whether a backward precedes that peak's last forward."""
    live = peak = 0
    backward_before_peak = seen_backward = False
    for step in program(name, rank, stages, microbatches):
        if step.kind == "F":
            live += 1
            if live > peak:
                peak, backward_before_peak = live, seen_backward
            elif live == peak:
                backward_before_peak = backward_before_peak or seen_backward
        elif step.kind == "B":
            live -= 1
            seen_backward = True
    return peak, backward_before_peak


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.timing in PROGRAMS])
def test_the_memory_counts_are_the_simulated_programs(name: str) -> None:
    """The micro-batches in flight and the gradients-before-peak the memory model reads
    from a spec are what the cost model's program of that schedule does."""
    spec = schedule_spec(name)
    for pp, mb in itertools.product((2, 3, 4, 8), range(1, 13)):
        if spec.microbatches_at_least_pp and mb < pp:
            continue
        p = ParallelConfig(pp=pp, pp_schedule=name, microbatches=mb)
        for rank in range(pp):
            peak, backward_first = _held(name, rank, pp, mb)
            assert in_flight(p, rank) == peak, (pp, mb, rank)
            assert grads_held_at_activation_peak(p, rank, 1) == backward_first, (pp, mb, rank)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_in_flight_is_within_the_micro_batches(name: str) -> None:
    spec = schedule_spec(name)
    for pp, mb, virtual in itertools.product((2, 4), (4, 8, 16), (1, 2, 3)):
        v = spec.stages_per_rank(virtual)
        held = [spec.in_flight(mb, pp, rank, v) for rank in range(pp)]
        assert all(1 <= h <= mb for h in held), (pp, mb, v, held)
        assert held == sorted(held, reverse=True), "the first rank holds the most"
