"""The step's fixed costs (analysis/fixed.py), each held to a hand computation for one shape,
and the terms the plan prints and carries in its JSON (issue 47)."""

from __future__ import annotations

import json

import pytest

from boostlr.analysis.chunktime import collective_alpha
from boostlr.analysis.costmodel import planning_config, predict
from boostlr.analysis.fixed import fixed_parts
from boostlr.analysis.hardware import load_profile
from boostlr.analysis.memory import rank_params
from boostlr.cli import main
from boostlr.config import build_config

A100 = load_profile("a100-40gb")
STREAM = 1555e9 * 0.9  # the profile's HBM bandwidth times its stream_efficiency
LAUNCH = 3.4e-6


def _cfg(**over: object):
    base = {
        "model.preset": "60M",
        "model.arch": "cola",
        "model.vocab_size": 4096,
        "data.seq_len": 256,
        "train.batch_size": 1,
        "train.grad_accum": 4,
        "train.dtype": "bfloat16",
        "parallel.tp": 1,
    }
    base.update(over)
    return planning_config(build_config(overrides=[(k, str(v)) for k, v in base.items()]))


def _local(cfg) -> int:
    p = cfg.parallel
    return rank_params(cfg.model, p.strategy_for(cfg.model.arch), p, 0).local


def test_each_fixed_term_equals_the_hand_computation_for_one_shape() -> None:
    """60M CoLA on one A100, bf16, one sequence x 4 accumulated: every pass over the n
    parameters at the streaming bandwidth, by hand."""
    cfg = _cfg()
    n = _local(cfg)
    parts = fixed_parts(cfg, A100, rank_params(cfg.model, None, cfg.parallel, 0))
    assert parts["optimizer_s"] == pytest.approx(28 * n / STREAM + 2 * LAUNCH)  # p,g,m,v
    assert parts["clip_s"] == pytest.approx((4 + 8) * n / STREAM + 2 * LAUNCH)  # norm, scale
    assert parts["zero_grad_s"] == 0.0  # set_to_none: no pass
    assert parts["grad_accumulation_s"] == pytest.approx(3 * 12 * n / STREAM)  # 3 adds
    assert parts["weight_cast_s"] == pytest.approx((4 + 4) * 6 * n / STREAM)  # fwd + bwd
    fp32 = fixed_parts(
        _cfg(**{"train.dtype": "float32"}), A100, rank_params(cfg.model, None, cfg.parallel, 0)
    )
    assert fp32["weight_cast_s"] == 0.0  # nothing cast in fp32
    ckpt = _cfg(**{"parallel.act_ckpt": "block"})
    recast = fixed_parts(ckpt, A100, rank_params(ckpt.model, None, ckpt.parallel, 0))
    assert recast["weight_cast_s"] == pytest.approx((8 + 4) * 6 * n / STREAM)  # + recompute


def test_collective_latency_is_nccls_base_plus_a_step_per_ring_hop() -> None:
    """An all-reduce over 4 GPUs on NVLink: 8.4 µs base + 2(4-1) x 3.4 µs + one launch per
    call (NCCL's Ring/Simple constants); an all-gather has g-1 steps."""
    assert collective_alpha("all_reduce", 10, 4, 4, A100) == pytest.approx(
        10 * (8.4e-6 + 6 * 3.4e-6 + LAUNCH)
    )
    assert collective_alpha("all_gather", 1, 4, 8, A100) == pytest.approx(
        8.4e-6 + 3 * 14e-6 + LAUNCH  # spans two nodes: the network's per-step latency
    )
    assert collective_alpha("all_reduce", 5, 1, 1, A100) == 0.0


def test_wave_quantization_and_split_k_by_hand() -> None:
    """A100 (108 SMs), the best of the 256x128, 128x128, 128x64 tiles: [4096, 1024] is
    512 tiles of 128x64 in 5 waves; [4096, 256] with k 4096 is 32 tiles of 256x128, split
    3 ways along k to 96 in one wave."""
    assert A100.wave_efficiency(4096, 4096, 1024) == pytest.approx(512 / 540)
    assert A100.wave_efficiency(4096, 4096, 256) == pytest.approx(96 / 108)
    big = A100.gemm_eff(4096, 4096, 1024)
    assert big == pytest.approx(A100.gemm_eff(4096, 4096, 1024, waves=False) * 512 / 540)


def test_fixed_share_grows_as_the_micro_batch_shrinks_and_compile_cuts_launches() -> None:
    shares = [
        predict(_cfg(**{"train.batch_size": b, "data.seq_len": 2048}), A100).fixed["fixed_share"]
        for b in (1, 2, 4, 8)
    ]
    assert shares == sorted(shares, reverse=True) and shares[0] > 2 * shares[-1]
    eager = predict(_cfg(), A100).fixed
    compiled = predict(_cfg(**{"train.compile": "true"}), A100).fixed
    assert eager["kernel_mode"] == "eager" and compiled["kernel_mode"] == "compiled"
    assert compiled["kernels_per_step"] < eager["kernels_per_step"]
    assert eager["launch_s"] == pytest.approx(eager["kernels_per_step"] * LAUNCH)


def test_host_dispatch_is_the_ops_per_kernel_at_the_host_cost_less_the_launches() -> None:
    """Eager: each planned kernel stands for the strategy's dispatched ops (BTP in bf16:
    3.1; the plain model in fp32: 1.8), each at the profile's ``host_op_us``; the launch
    already inside the chunk times is not charged twice. Compiled: no term."""
    import dataclasses

    from boostlr.analysis.fixed import host_dispatch_time

    btp = _cfg(**{"parallel.tp": 4, "parallel.tp_strategy": "btp"})
    assert host_dispatch_time(btp, A100, 1000) == pytest.approx(1000 * (3.1 - 1) * LAUNCH)
    plain = _cfg(**{"train.dtype": "float32"})
    slow_host = dataclasses.replace(A100, host_op=20e-6)
    assert host_dispatch_time(plain, slow_host, 1000) == pytest.approx(
        1000 * (1.8 * 20e-6 - LAUNCH)
    )
    assert host_dispatch_time(_cfg(**{"train.compile": "true"}), slow_host, 1000) == 0.0
    fixed = predict(btp, A100).fixed
    assert fixed["host_ops_per_step"] == pytest.approx(3.1 * fixed["kernels_per_step"])
    assert fixed["host_dispatch_s"] == pytest.approx(fixed["kernels_per_step"] * (3.1 - 1) * LAUNCH)
    # In series: the step grows by exactly the term when the host gets slower.
    slower = dataclasses.replace(A100, host_op=2 * LAUNCH)
    grown = predict(btp, slower).step_time - predict(btp, A100).step_time
    assert grown == pytest.approx(fixed["host_ops_per_step"] * LAUNCH)


def test_plan_json_carries_each_fixed_term(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--hardware", "a100-40gb", "--json", "--model.preset", "7B"]
    args += ["--parallel.tp", "4", "--train.batch_size", "1", "--data.seq_len", "4096"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    keys = {"optimizer_s", "clip_s", "zero_grad_s", "grad_accumulation_s", "weight_cast_s"}
    keys |= {"launch_s", "tp_alpha_s", "pp_alpha_s", "dp_alpha_s", "fixed_s", "fixed_share"}
    keys |= {"host_dispatch_s", "host_ops_per_step", "host_op_us"}
    for row in rows:
        assert keys <= set(row["fixed"]), row["fixed"].keys()
        assert row["fixed"]["tp_alpha_s"] > 0 and row["fixed"]["kernel_mode"] == "eager"
        assert 0 < row["fixed"]["fixed_s"] < row["step_time_s"]


def test_plan_says_when_fixed_costs_dominate(capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny step on an A100 is launches and latency: the plan says so under its table;
    a 7B step at four sequences per micro-batch is not."""
    small = ["plan", "--hardware", "a100-40gb", "--model.preset", "60M", "--data.seq_len", "128"]
    small += ["--train.dtype", "bfloat16", "--parallel.tp", "2", "--train.batch_size", "1"]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "fixed costs per step" in out and "fixed costs dominate" in out
    big = ["plan", "--hardware", "a100-40gb", "--model.preset", "7B", "--parallel.tp", "4"]
    big += ["--train.dtype", "bfloat16", "--train.batch_size", "4", "--data.seq_len", "4096"]
    assert main(big) == 0
    out = capsys.readouterr().out
    assert "fixed costs per step" in out and "dominate" not in out
