"""Memory accounting: what a rank's tensors hold, its floor, and the per-phase report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import tiny_run_config

from boostlr.models.llama import build_model
from boostlr.train import run as trainer
from boostlr.train.memory import MB, held_tensor_mb
from boostlr.train.optim import build_optimizer, init_optimizer_state

PHASES = ["start-up", "materialise", "optimizer state", "forward/backward", "step", "eval", "save"]


def test_held_tensors_count_each_storage_once(tmp_path: Path) -> None:
    cfg = tiny_run_config(tmp_path, **{"model.tie_embeddings": "true"}).model
    cfg.vocab_size = 97
    model = build_model(cfg, seed=0)
    params = list(model.parameters())  # the tied weight once
    opt = build_optimizer(params, tiny_run_config(tmp_path).train)
    init_optimizer_state(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    held = held_tensor_mb(params, opt)
    n = sum(p.numel() for p in params)
    assert held["mem_params_mb"] == pytest.approx(4 * n / MB)
    assert held["mem_grads_mb"] == pytest.approx(4 * n / MB)
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert held["mem_optim_mb"] == pytest.approx((8 * n + steps) / MB)  # AdamW's two moments


def test_rows_carry_memory_against_the_floor_and_phases_are_written(
    small_dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(small_dataset, **{"train.memory_phases": "true", "train.steps": 3})
    trainer.train(cfg, run, console=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "loss" in r]
    assert step_rows
    report = json.loads((run / "memory" / "rank0.json").read_text())
    assert list(report["phases"]) == PHASES
    for row in step_rows:
        held = row["mem_params_mb"] + row["mem_grads_mb"] + row["mem_optim_mb"]
        assert row["mem_grads_mb"] == pytest.approx(row["mem_params_mb"])
        assert row["mem_floor_mb"] == pytest.approx(held + report["runtime_mb"])
    assert report["runtime_mb"] > 50  # torch is loaded: the runtime is real
    assert report["held"]["mem_params_mb"] == pytest.approx(step_rows[-1]["mem_params_mb"])
    # The allocator's count sees the tensors: the step held at least the rank's own.
    step = report["phases"]["forward/backward"]
    held = sum(report["held"].values())
    assert step["allocated_peak_mb"] - report["runtime_allocated_mb"] >= held
    assert report["allocated_by"] in ("glibc", "jemalloc", "tcmalloc")
