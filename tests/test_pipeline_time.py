"""The pipeline terms of the step-time model (``analysis/schedule.py``, ``costmodel.predict``).

The schedule programs are held to the order the real trainer runs its chunks (a traced
pp2 x tp2 rank's ledger, where every forward chunk of a non-last stage ends in its
activation send and every backward chunk of a non-first stage in its gradient send), and the
simulation to the textbook closed forms where those are exact.
"""

from __future__ import annotations

import itertools

import pytest
from parallel_cases import layout_config

from boostlr.analysis.chunktime import collective_time
from boostlr.analysis.comm import fsdp_pipeline_bytes
from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import load_profile
from boostlr.analysis.memory import rank_params
from boostlr.analysis.schedule import pipeline_span, program
from boostlr.config import build_config

FREE = {"act": 0.0, "grad": 0.0}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule: str) -> None:
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 5, 8, 16)):
        if schedule == "1f1b" and m < p:
            continue  # torch's Schedule1F1B refuses it, as the config does
        span = pipeline_span(schedule, m, [1.0] * p, [2.0] * p, FREE)
        assert span == pytest.approx((m + p - 1) * 3.0), (p, m)


def test_unequal_stages_fill_once_then_run_at_the_slowest() -> None:
    """The last stage (the head) slowest: fill and drain pass every stage once, the other
    ``m - 1`` micro-batches go at the slowest stage's pace, not ``(m + p - 1)`` x slowest."""
    fwd, bwd = [1.0, 1.0, 1.1, 1.4], [2.0, 2.0, 2.2, 2.9]
    slots = [f + b for f, b in zip(fwd, bwd, strict=True)]
    for m in (4, 6, 9):
        span = pipeline_span("1f1b", m, fwd, bwd, FREE)
        assert span == pytest.approx(sum(slots) + (m - 1) * max(slots))
        assert span < (m + len(slots) - 1) * max(slots)


def test_transfers_on_the_critical_path() -> None:
    """pp 2, two micro-batches, F=1, B=2, a transfer t: stage 0's first activation, the
    fused (activation 1, gradient 0) exchange, and gradient 1 wait one transfer each."""
    t = 0.25
    span = pipeline_span("1f1b", 2, [1.0, 1.0], [2.0, 2.0], {"act": t, "grad": t})
    assert span == pytest.approx(9.0 + 3 * t)


def _chunks(records: list[dict]) -> list[str]:
    """The rank's chunk order from its ledger: phase runs, forward runs split at each
    activation send (a forward chunk ends in one), backward runs at each gradient send."""
    runs: list[list[dict]] = []
    for r in records:
        phase = "F" if r["phase"] == "fwd" else "B"
        if runs and runs[-1][0]["_p"] == phase:
            runs[-1].append({**r, "_p": phase})
        else:
            runs.append([{**r, "_p": phase}])
    out = []
    for run in runs:
        phase = run[0]["_p"]
        sends = sum(1 for r in run if r["op"] == "send")
        out.append(f"{phase}{sends}")
    return out


def _expected(steps, first: bool, last: bool) -> list[str]:
    kinds = [s.kind for s in steps if s.kind in "FB"]
    runs: list[list[str]] = []
    for k in kinds:
        if runs and runs[-1][0] == k:
            runs[-1].append(k)
        else:
            runs.append([k])
    out = []
    for run in runs:
        sends = len(run) if (run[0] == "F" and not last) or (run[0] == "B" and not first) else 0
        out.append(f"{run[0]}{sends}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_programs_follow_the_traced_trainer(schedule: str) -> None:
    """Every pipeline rank of a traced pp2 x tp2 run issues its chunks in the program's order
    (TP collectives mark each chunk's phase, the point-to-point sends its end)."""
    from boostlr.analysis.costmodel import planning_config
    from boostlr.trace.run import trace_rank

    cfg = layout_config(
        "cola",
        "btp",
        2,
        1,
        2,
        **{"parallel.pp_schedule": schedule, "parallel.microbatches": 4},
    )
    traces = [trace_rank(planning_config(cfg), r) for r in (0, 2)]  # tp rank 0 of each stage
    for t in traces:
        stage = t.pp_stage
        assert t.steps_equal
        steps = program(schedule, stage, 2, 4)
        assert _chunks(t.records) == _expected(steps, stage == 0, stage == 1), stage


def test_paper_13b_pipeline_row_is_the_simulated_schedule() -> None:
    """The 13B tp4 x pp2 row: the step is the simulated span of the two stages' chunks
    (plus the fixed costs in series: optimizer, clipping, accumulation, casts, the host's
    dispatch), and its bubble is between one slowest slot and ``p - 1`` of them plus the
    imbalance (the first stage is faster: no head)."""
    hw = load_profile("a100-40gb")
    over = {
        "model.preset": "13B",
        "model.arch": "cola",
        "model.vocab_size": 32000,
        "data.seq_len": 4096,
        "train.batch_size": 4,
        "train.grad_accum": 1,
        "train.dtype": "bfloat16",
        "parallel.tp": 4,
        "parallel.pp": 2,
        "parallel.dp": 1,
        "parallel.tp_strategy": "btp",
        "parallel.act_ckpt": "none",
        "parallel.pp_schedule": "1f1b",
        "parallel.microbatches": 4,
    }
    cfg = build_config(overrides=[(k, str(v)) for k, v in over.items()])
    pred = predict(cfg, hw)
    parts = pred.parts
    slot = (parts["gemm_elementwise_s"] + parts["tp_comm_s"]) / 4
    assert slot * 0.9 < parts["bubble_s"] < slot * 1.1  # one slot: p - 1 = 1
    assert 0 < parts["pp_comm_s"] < 0.05 * pred.step_time
    assert pred.step_time == pytest.approx(
        4 * slot
        + parts["bubble_s"]
        + parts["pp_comm_s"]
        + sum(
            parts[k]
            for k in (
                "optimizer_s",
                "clip_s",
                "zero_grad_s",
                "grad_accumulation_s",
                "weight_cast_s",
                "host_dispatch_s",
            )
        )
    )


def test_ddp_mode_under_a_pipeline_exposes_the_final_reduction() -> None:
    """``ddp`` under PP: torch's stage reduce-scatters the whole stage after the last
    backward, so at least that reduction is exposed; ``fsdp`` reduces per micro-batch
    inside the backward."""
    hw = load_profile("a100-40gb")
    cfg = build_config(
        overrides=[
            ("model.preset", "1B"),
            ("model.vocab_size", "32000"),
            ("data.seq_len", "2048"),
            ("train.batch_size", "4"),
            ("parallel.pp", "2"),
            ("parallel.dp", "2"),
            ("parallel.tp", "2"),
            ("parallel.dp_mode", "ddp"),
            ("parallel.vocab_dp", "false"),
            ("parallel.microbatches", "4"),
        ]
    )
    p, m = cfg.parallel, cfg.model
    pred = predict(cfg, hw)
    params = rank_params(m, p.strategy_for(m.arch), p, 0)
    modules = [n for n in params.modules if n]
    reduce = fsdp_pipeline_bytes(modules, p.dp, 1, False, 4, 0)
    t_reduce = collective_time("reduce_scatter", reduce, len(modules), p.dp, p.dp * p.tp, hw)
    assert t_reduce > 0
    assert pred.parts["dp_comm_exposed_s"] >= t_reduce
