"""Tensor parallelism against the single-device model, on real gloo process groups.

For every arch with each of its strategies, TP degree, grouping / norm mode and activation
checkpointing mode: the loss and every parameter gradient (gathered to full shape) match
the single-device model with the same weights, the communication ledger equals the
DESIGN formula exactly, and replicated parameters keep identical gradients on all ranks.
Each world size spawns one process group and checks the whole matrix inside it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.profiler import ProfilerActivity, profile

from boostlr.analysis.comm import per_block_forward, tp_comm_volume
from boostlr.config import ModelConfig, build_config
from boostlr.models.llama import build_model
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.tensor_parallel import TensorParallelModel, clip_gradients

VOCAB = 101  # not divisible by 2 or 4: exercises vocab padding
BATCH, SEQ = 2, 8
TOL = 2e-5  # max |g - g_ref| / max |g_ref| per tensor: fp32 reduction-order noise


def tiny_cfg(
    arch: str, n_kv_heads: int, lax_gate: str = "factored", tie: bool = False
) -> ModelConfig:
    overrides = [("model.preset", "tiny"), ("model.arch", arch), ("model.lax_gate", lax_gate)]
    overrides.append(("model.tie_embeddings", str(tie)))
    cfg = build_config(overrides=overrides + [("model.n_kv_heads", str(n_kv_heads))]).model
    cfg.vocab_size = VOCAB
    return cfg


def perturbed_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded weights with every parameter moved off its init (LaX gates start at zero)."""
    model = build_model(cfg, seed=1)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return {k: v.clone() for k, v in model.state_dict().items()}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def matrix(tp: int) -> list[dict]:
    """Every arch x its strategies x options that apply to it."""
    cases = [dict(arch="full", strategy="megatron", act_ckpt=ckpt) for ckpt in ("none", "block")]
    for arch in ("cola", "svd", "lax"):
        cases += [dict(arch=arch, strategy="vanilla", act_ckpt=c) for c in ("none", "block")]
        for grouping, norm, ckpt in itertools.product(
            (True, False), ("online", "sync"), ("none", "lowrank", "block")
        ):
            cases.append(
                dict(arch=arch, strategy="btp", grouping=grouping, norm=norm, act_ckpt=ckpt)
            )
    cases.append(dict(arch="lax", strategy="btp", lax_gate="full", act_ckpt="lowrank"))
    cases.append(dict(arch="lax", strategy="vanilla", lax_gate="full", act_ckpt="none"))
    cases.append(dict(arch="full", strategy="megatron", tie=True, act_ckpt="none"))
    cases.append(dict(arch="cola", strategy="vanilla", tie=True, act_ckpt="block"))
    if tp == 1:  # the plain model, as the trainer runs it at TP 1
        cases.append(dict(arch="lax", strategy=None, tie=True, act_ckpt="block"))
        cases.append(dict(arch="cola", strategy=None, act_ckpt="none"))
    for case in cases:
        case["n_kv_heads"] = 2 if tp == 2 else 4  # GQA where the degree allows it
        # 10-step curves at T 1 and 2. At T 4 (four ranks on CI's two cores every collective
        # waits ~30 ms) the single-step loss/gradient/ledger checks cover the matrix.
        case["curve"] = tp < 4
    return cases


def check_case(case: dict, comm: GroupComm, bf16: bool = False) -> dict:
    """Run one configuration on this rank; return a small, picklable report."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    cfg = tiny_cfg(
        case["arch"], case["n_kv_heads"], case.get("lax_gate", "factored"), case.get("tie", False)
    )
    state = perturbed_state(cfg)
    inputs, targets = batch()

    single = GroupComm(None, "single", CommLedger())
    plain = build_model(cfg, seed=1)
    plain.load_state_dict(state)
    reference = TensorParallelModel(plain, None, TPContext(single, cfg))
    with autocast:
        ref_loss = reference(inputs, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_shards()}

    model = build_model(cfg, seed=1)
    model.load_state_dict(state)
    ctx = TPContext(
        comm,
        cfg,
        norm=case.get("norm", "online"),
        grouping=case.get("grouping", True),
        act_ckpt=case["act_ckpt"],
    )
    tp_model = TensorParallelModel(model, case["strategy"], ctx)
    comm.ledger.reset()
    with autocast:
        loss = tp_model(inputs, targets)
    loss.backward()
    measured = comm.ledger.step_metrics()

    if cfg.tie_embeddings:  # the tie must survive sharding
        assert tp_model.model.lm_head.weight is tp_model.model.embed_tokens.weight
    grads = tp_model.full_grads()
    worst = max(
        ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        for n, g in ref_grads.items()
    )
    expected = tp_comm_volume(
        cfg,
        case["strategy"],
        comm.size,
        BATCH * SEQ,
        norm=ctx.norm,
        grouping=ctx.grouping,
        act_ckpt=ctx.act_ckpt,
        act_size=2 if bf16 else 4,
    ).metrics()
    curves = (
        None
        if bf16 or not case.get("curve")
        else (
            train_curve(reference, single, ref_loss.item()),
            train_curve(tp_model, comm, loss.item()),
        )
    )
    replicas_equal = True
    if comm.size > 1:
        for name, p in tp_model.named_shards():
            if tp_model.specs[name].dim is None:
                copies = [torch.empty_like(p.grad) for _ in range(comm.size)]
                dist.all_gather(copies, p.grad.contiguous(), group=comm.group)
                replicas_equal &= all(torch.equal(c, copies[0]) for c in copies)
    return {
        "case": case,
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "worst_grad_error": worst,
        "grads_complete": set(grads) == set(ref_grads),
        "ledger": measured,
        "formula": expected,
        "replicas_equal": replicas_equal,
        "tp": comm.size,
        "curves": curves,
    }


def train_curve(model: TensorParallelModel, comm: GroupComm, first_loss: float) -> list[float]:
    """Nine more AdamW steps (clipped like the trainer) on the batch whose grads are in place."""
    inputs, targets = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    misc = GroupComm(comm.group, "tp_misc", comm.ledger)
    losses = [first_loss]
    for _ in range(9):
        clip_gradients(model, 1.0, misc)
        opt.step()
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        losses.append(loss.item())
    return losses


def run_matrix(rank: int, world_size: int) -> list[dict]:
    comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
    return [check_case(case, comm) for case in matrix(world_size)]


def assert_reports(reports: list[dict]) -> None:
    for r in reports:
        label = r["case"]
        assert r["grads_complete"], label
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), label
        assert r["worst_grad_error"] < TOL, (label, r["worst_grad_error"])
        assert r["ledger"] == r["formula"], (label, r["ledger"], r["formula"])
        assert r["replicas_equal"], label
        if r["case"]["act_ckpt"] == "lowrank":
            assert r["ledger"]["comm_tp_bytes_recompute"] == 0, label
        if r["curves"] is not None:  # 10 training steps follow the single-device curve
            single, tp = r["curves"]
            assert single[-1] < single[0] - 0.05, (label, single)
            # Adam divides by sqrt(v), so fp32 rounding noise grows a little per step.
            for a, b in zip(single, tp, strict=True):
                assert abs(a - b) <= 1e-3 * abs(a), (label, single, tp)
        if r["case"]["act_ckpt"] == "block" and r["tp"] > 1:
            assert r["ledger"]["comm_tp_bytes_recompute"] > 0, label


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_matches_single_device(world_size: int) -> None:
    per_rank = run_distributed(run_matrix, world_size, timeout_s=600)
    for reports in per_rank:
        assert_reports(reports)
    assert per_rank[0][0]["loss"] == per_rank[-1][0]["loss"]  # all ranks agree


BF16_CASES = [
    dict(arch="full", strategy="megatron", act_ckpt="block"),
    dict(arch="lax", strategy="vanilla", act_ckpt="none"),
    dict(arch="cola", strategy="btp", act_ckpt="lowrank"),
    dict(arch="svd", strategy="btp", grouping=False, norm="sync", act_ckpt="block"),
    dict(arch="lax", strategy="btp", act_ckpt="none"),
]


def run_bf16(rank: int, world_size: int) -> list[dict]:
    comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
    return [check_case({**c, "n_kv_heads": 2}, comm, bf16=True) for c in BF16_CASES]


def test_bf16_autocast_payloads_match_the_formula() -> None:
    """Under bf16 the activations travel in bf16; only residual and loss stats stay fp32."""
    for r in run_distributed(run_bf16, 2, timeout_s=300)[0]:
        assert r["ledger"] == r["formula"], (r["case"], r["ledger"], r["formula"])
        assert abs(r["loss"] - r["ref_loss"]) <= 2e-2 * abs(r["ref_loss"]), r["case"]
        assert r["worst_grad_error"] < 0.1, (r["case"], r["worst_grad_error"])
        assert r["replicas_equal"], r["case"]


def test_strategies_at_tp1_run_the_same_math_without_communication() -> None:
    comm = GroupComm(None, "tp", CommLedger())
    reports = [check_case(case, comm) for case in matrix(1)]
    assert_reports(reports)
    assert all(r["ledger"]["comm_tp_calls"] == 0 for r in reports)


def test_btp_moves_fewer_bytes_than_vanilla_and_megatron() -> None:
    """DESIGN's claim at LLaMA-7B shapes: ~5.9x less than vanilla, below full-rank Megatron."""
    cola = build_config(overrides=[("model.preset", "7B"), ("model.arch", "cola")]).model
    full = build_config(overrides=[("model.preset", "7B"), ("model.arch", "full")]).model
    cola.vocab_size = full.vocab_size = 32000
    tokens = 4 * 4096

    def per_block(cfg: ModelConfig, strategy: str) -> int:
        return per_block_forward(cfg, strategy, 8, tokens, act_size=2)  # bf16

    btp, vanilla, megatron = (
        per_block(cola, "btp"),
        per_block(cola, "vanilla"),
        per_block(full, "megatron"),
    )
    assert 5.8 < vanilla / btp < 6.0
    assert btp < megatron
    # The BOOST authors' figures for one block forward in bf16 (GiB): BTP 0.22, full 0.25,
    # vanilla 1.32 (our exact count gives 1.30: they round the MLP width differently).
    gib = 1 / 2**30
    assert round(btp * gib, 2) == 0.22 and round(megatron * gib, 2) == 0.25
    assert abs(vanilla * gib - 1.32) < 0.03


def _forward_memory(act_ckpt: str) -> int:
    """Bytes allocated and still held at the end of the forward: the saved activations."""
    cfg = tiny_cfg("cola", 4)
    model = TensorParallelModel(
        build_model(cfg, seed=0),
        "btp",
        TPContext(GroupComm(None, "tp", CommLedger()), cfg, act_ckpt=act_ckpt),
    )
    tokens = torch.randint(0, VOCAB, (4, 129), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(tokens[:, :-1], tokens[:, 1:])
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return held


def test_lowrank_checkpointing_lowers_activation_memory() -> None:
    none, lowrank = _forward_memory("none"), _forward_memory("lowrank")
    assert lowrank < 0.5 * none, (none, lowrank)
