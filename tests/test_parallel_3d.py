"""pp x dp x tp layouts against the single-device model, on real gloo process groups.

Every check compares one step from identical weights (the single-device model takes the
layout's current weights before each step), so fp32 reduction-order noise never compounds
into a diverging trajectory: losses agree to ~1e-6 relative, and the layout's gradients are
as close to the exact (float64) ones as the single-device fp32 model's are (``fp32_noise``).
"""

from __future__ import annotations

import pytest
from distributed import run_distributed
from fp32_noise import bf16_layout_bound, layout_bound
from parallel_cases import layout_config, run_cases

from boostlr.analysis.comm import (
    fsdp_bytes,
    fsdp_pipeline_bytes,
    pp_send_bytes,
    vocab_dp,
    vocab_dp_bytes,
)
from boostlr.analysis.memory import stage_modules

LOSS_TOL = 1e-5


def assert_follows(label: str, report: dict) -> None:
    losses, ref = report["losses"], report["ref_losses"]
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(b), (label, losses, ref)
    for a, b in zip(report["norms"], report["ref_norms"], strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(b), (label, report["norms"], report["ref_norms"])
    for layout, single in report["vs64"]:
        assert layout <= layout_bound(single), (
            label,
            report["vs64"],
            report["worst_params"],
        )
    if len(losses) > 1:
        assert losses[-1] < losses[0], (label, losses)  # it trains


def run(world: int, cases: list[tuple[str, object, int]]) -> list[dict]:
    per_rank = run_distributed(run_cases, world, cases, timeout_s=900)
    for reports in per_rank:
        for label, report in reports.items():
            assert_follows(label, report)
    return per_rank


def test_dp_and_pp_with_tp_match_single_device_gradients() -> None:
    """dp2 x tp2 and pp2 x tp2 (4 ranks): every strategy, one step each, plus ddp mode."""
    cases = []
    for arch, strategy in (("full", "megatron"), ("cola", "vanilla"), ("lax", "btp")):
        cases.append((f"dp2tp2 {arch} {strategy}", layout_config(arch, strategy, 1, 2, 2), 1))
        cases.append((f"pp2tp2 {arch} {strategy}", layout_config(arch, strategy, 2, 1, 2), 1))
    ddp = layout_config("svd", "btp", 1, 2, 2, **{"parallel.dp_mode": "ddp"})
    cases.append(("dp2tp2 svd btp ddp", ddp, 1))
    cases.append(("dp2tp2 svd btp ddp 2 steps", ddp, 2))
    fsdp_vocab = {"parallel.vocab_dp": "false"}  # the tables as FSDP units, gathered whole
    cases.append(
        ("dp2tp2 cola btp vocab fsdp", layout_config("cola", "btp", 1, 2, 2, **fsdp_vocab), 1)
    )
    ddp_vocab = layout_config(
        "full", "megatron", 1, 2, 2, **fsdp_vocab, **{"parallel.dp_mode": "ddp"}
    )
    cases.append(("dp2tp2 full megatron ddp vocab fsdp", ddp_vocab, 1))
    lowrank_ckpt = layout_config("cola", "btp", 2, 1, 2, **{"parallel.act_ckpt": "lowrank"})
    cases.append(("pp2tp2 cola btp lowrank-ckpt", lowrank_ckpt, 1))
    per_rank = run(4, cases)
    for reports in per_rank:
        for label, report in reports.items():
            assert_ledger(label, report, dict(cases_by_label(cases))[label])


def vocab_bytes(cfg, pp_rank: int, micro_tokens: int, act_size: int = 4) -> int:
    """The dp bytes of one pipeline micro-batch's embedding and head (rows split over dp)."""
    p, m = cfg.parallel, cfg.model
    return sum(
        vocab_dp_bytes(
            m, p.strategy_for(m.arch), p.tp, vocab_dp(m, p), micro_tokens, first, last, act_size
        )
        for _, first, last in stage_modules(p, m.n_layers, pp_rank)
    )


def cases_by_label(cases):
    return [(label, cfg) for label, cfg, _ in cases]


def assert_ledger(label: str, report: dict, cfg) -> None:
    """One step's dp and pp bytes equal the formulas of analysis/comm.py."""
    p, m = cfg.parallel, cfg.model
    metrics = report["metrics"]
    pp_rank = report["coords"][0]
    micro_tokens = cfg.train.batch_size // p.pp_microbatches * cfg.data.seq_len
    expected_pp = (
        pp_send_bytes(
            m,
            p.strategy_for(m.arch),
            p.tp,
            micro_tokens,
            p.pp_microbatches,
            first=pp_rank == 0,
            last=pp_rank == p.pp - 1,
        )
        if p.pp > 1
        else 0
    )
    assert metrics["comm_pp_bytes"] == expected_pp, (label, metrics, expected_pp)
    if p.pp == 1 and len(report["losses"]) == 1:
        expected_dp = fsdp_bytes(report["fsdp_modules"], p.dp, 1, p.dp_mode == "fsdp")
        expected_dp += vocab_bytes(cfg, pp_rank, micro_tokens)
        assert metrics["comm_dp_bytes"] == expected_dp, (label, metrics, expected_dp)


MATRIX = [  # (arch, strategy, schedule, extra): each schedule under btp and a baseline
    ("full", "megatron", "gpipe", {}),
    ("cola", "vanilla", "1f1b", {"parallel.act_ckpt": "block"}),
    ("cola", "btp", "interleaved", {}),
    ("lax", "btp", "1f1b", {"parallel.act_ckpt": "lowrank"}),
    ("svd", "btp", "gpipe", {"parallel.dp_mode": "ddp"}),
]


@pytest.mark.slow
def test_pp2_dp2_tp2_follows_the_single_device_curve() -> None:
    """8 ranks, 5 clipped AdamW steps per case, every schedule."""
    cases = []
    for arch, strategy, schedule, extra in MATRIX:
        cfg = layout_config(arch, strategy, 2, 2, 2, **{"parallel.pp_schedule": schedule, **extra})
        cases.append((f"pp2dp2tp2 {arch} {strategy} {schedule} {extra}", cfg, 5))
    per_rank = run(8, cases)
    # FSDP under a pipeline: fsdp reshards and reduce-scatters per pipeline micro-batch,
    # ddp gathers once per step (analysis/comm.py's formula, every rank).
    for reports in per_rank:
        for label, cfg, steps in cases:
            report, p = reports[label], cfg.parallel
            expected = fsdp_pipeline_bytes(
                report["fsdp_modules"], p.dp, steps, p.dp_mode == "fsdp", p.pp_microbatches
            )
            micro_tokens = cfg.train.batch_size // p.pp_microbatches * cfg.data.seq_len
            pp_rank = report["coords"][0]
            expected += steps * p.pp_microbatches * vocab_bytes(cfg, pp_rank, micro_tokens)
            assert report["metrics"]["comm_dp_bytes"] == expected, (label, report["coords"])
    # Memory contract: every rank holds only its shards. Summed over the 8 ranks, the
    # parameter elements are the single-device model's, replicated tp-fold only for
    # parameters the strategy keeps whole (norm gains, LaX crossings).
    for label in per_rank[0]:
        held = sum(sum(r[label]["local_numel"].values()) for r in per_rank)
        biggest = max(sum(r[label]["local_numel"].values()) for r in per_rank)
        assert held > 0 and biggest * 4 < held, (label, held, biggest)


def _bf16_cases(rank: int, world: int, cases) -> dict:
    from parallel_cases import compare_bf16_step

    return {label: compare_bf16_step(rank, world, cfg) for label, cfg in cases}


def test_bf16_fsdp_gathers_bf16_and_matches_one_device_autocast() -> None:
    """train.dtype bfloat16: FSDP all-gathers bf16 parameters (half the bytes, counted by the
    ledger and the cost model), reduces fp32 gradients into fp32 master weights, and the loss
    and gradients match one device under autocast within bf16 rounding."""
    bf16 = {"train.dtype": "bfloat16"}
    cases = [
        ("dp4 cola", layout_config("cola", "btp", 1, 4, 1, **bf16)),
        ("dp2tp2 cola btp", layout_config("cola", "btp", 1, 2, 2, **bf16)),
    ]
    for reports in run_distributed(_bf16_cases, 4, cases, timeout_s=600):
        for label, cfg in cases:
            r, dp = reports[label], cfg.parallel.dp
            assert abs(r["loss"] - r["ref_loss"]) <= 2e-2 * abs(r["ref_loss"]), (label, r)
            assert r["layout64"] <= bf16_layout_bound(r["single64"]), (label, r)
            assert r["param_dtypes"] == {"torch.float32"} == r["grad_dtypes"], (label, r)
            expected = fsdp_bytes(r["fsdp_modules"], dp, 1, True, param_bytes=2)
            tokens = cfg.train.batch_size * cfg.data.seq_len
            expected += vocab_bytes(cfg, 0, tokens, act_size=2)
            assert r["metrics"]["comm_dp_bytes"] == expected, (label, r["metrics"], expected)
