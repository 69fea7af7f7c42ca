"""The host's dispatched aten ops per planned kernel, as the cost model charges them (its
host term, issue 47), held against real trainer steps: each strategy's
``host_ops_per_kernel`` (``specs/strategy.py``) within 15% of what a block dispatches on real
gloo ranks at TP 2, and the plain model's (plain tensors at tp 1) on one rank, in fp32 and
bf16. A change to the runtime that adds or removes per-op work (a cast, a view, a wrapper)
fails here until the spec says it."""

from __future__ import annotations

import dataclasses

import torch
from distributed import run_distributed

from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import load_profile
from boostlr.config import RunConfig, build_config
from boostlr.host_ops import classify, count_dispatched, host_seconds_per_op, step_census
from boostlr.specs.strategy import host_ops_per_kernel

TOLERANCE = 0.15
DTYPES = ("float32", "bfloat16")
TP_CASES = (("full", "megatron"), ("cola", "vanilla"), ("cola", "btp"))
PLAIN_ARCHS = ("full", "cola", "lax")


def _config(arch: str, strategy: str | None, dtype: str, layers: int) -> RunConfig:
    over = [("model.preset", "tiny"), ("model.arch", arch), ("model.vocab_size", "512")]
    over += [("data.seq_len", "8"), ("train.batch_size", "1"), ("train.dtype", dtype)]
    if strategy is not None:
        over += [("parallel.tp", "2"), ("parallel.tp_strategy", strategy)]
    cfg = build_config(overrides=over)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers))


def _ops(cfg: RunConfig) -> int:
    return sum(step_census(cfg, torch.device("cpu")).values())


def _block(arch: str, strategy: str | None, dtype: str) -> tuple[int, int]:
    """(dispatched ops, planned kernels) of one block: a 2-block step minus a 1-block one."""
    one, two = (_config(arch, strategy, dtype, n) for n in (1, 2))
    h200 = load_profile("h200")
    planned = [predict(c, h200).fixed["kernels_per_step"] for c in (one, two)]
    return _ops(two) - _ops(one), planned[1] - planned[0]


def _tp_blocks(rank: int, world_size: int) -> list[tuple[int, int]]:
    torch.set_num_threads(1)
    return [_block(a, s, d) for a, s in TP_CASES for d in DTYPES]


def _check(strategy: str | None, dtype: str, dispatched: int, kernels: int) -> str | None:
    spec = host_ops_per_kernel(strategy, dtype)
    measured = dispatched / kernels
    if abs(measured / spec - 1) > TOLERANCE:
        return f"{strategy or 'plain'} {dtype}: {measured:.2f} ops per kernel, spec {spec}"
    return None


def test_each_strategy_dispatches_its_specs_ops_per_kernel_at_tp2() -> None:
    blocks = run_distributed(_tp_blocks, 2, timeout_s=600)[0]
    cases = [(s, d) for _, s in TP_CASES for d in DTYPES]
    misses = [_check(s, d, *b) for (s, d), b in zip(cases, blocks, strict=True)]
    assert not [m for m in misses if m], misses


def _plain_blocks(rank: int, world_size: int) -> list[tuple[int, int]]:
    torch.set_num_threads(1)
    return [_block(a, None, d) for a in PLAIN_ARCHS for d in DTYPES]


def test_the_plain_model_dispatches_its_ops_per_kernel() -> None:
    """At TP 1 in a one-rank process group, as ``torchrun`` starts a one-GPU run."""
    blocks = run_distributed(_plain_blocks, 1, timeout_s=600)[0]
    cases = [(a, d) for a in PLAIN_ARCHS for d in DTYPES]
    misses = [_check(None, d, *b) for (_, d), b in zip(cases, blocks, strict=True)]
    assert not [m for m in misses if m], misses


def test_the_host_cost_per_op_is_a_step_over_its_ops() -> None:
    """``host_seconds_per_op`` divides a step's host time by the ops the profiler counts;
    ``classify`` knows a view, a cast that returned its input, and a kernel."""
    calls = []

    def step() -> None:
        calls.append(1)
        x = torch.ones(4)
        (x.view(2, 2).to(torch.float32) + 1).sum()

    seconds, ops = host_seconds_per_op(step, reps=3)
    assert ops == sum(count_dispatched(step).values()) and ops >= 4
    assert seconds > 0 and len(calls) == 3 + 1 + 3 + 1
    kinds = count_dispatched(step)
    assert kinds["view"] >= 1 and kinds["noop"] == 1 and kinds["write"] >= 2
    assert callable(classify)
