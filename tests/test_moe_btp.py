"""An MoE model under BTP at tp 2 equals one device: loss and every gradient within the fp32
noise bound (tests/fp32_noise.py), on real gloo ranks; and the router's partial logits ride
in the MLP norm's all-reduce (no collective of their own).

Each rank holds its BTP shards of the single-device weights (tests/tp_reference.py's
``sliced``): the d-slices of the residual's factors, the experts and router whole. Every TP
rank routes all tokens alike but runs only its half through the experts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import rank_device, run_distributed
from fp32_noise import float64_grads, layout_bound, relative_error
from tp_reference import shard_tensor, sliced

from boostlr.config import ModelConfig, ParallelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models.llama import build_model
from boostlr.parallel.btp_moe import (
    COMBINED_TAG,
    GRAD_TAG,
    LATENT_TAG,
    sum_moe_grads_over_tp,
    tp_partial_params,
)
from boostlr.parallel.context import TPContext
from boostlr.parallel.mesh import build_mesh

BATCH, SEQ = 2, 8
#: (arch, balance, grouping, act_ckpt)
CASES = [
    ("cola", "bias", True, "none"),
    ("lax", "aux", True, "block"),  # the block's collectives re-run in its re-forward
    ("svd", "aux", False, "none"),
]


def _cfg(arch: str, balance: str) -> ModelConfig:
    cfg = resolve_model(
        ModelConfig(
            preset="tiny", arch=arch, dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, n_layers=3,
            rank=4, moe_experts=4, moe_top_k=2, moe_ffn_dim=8, vocab_size=32,
            moe_dense_layers=1, moe_shared=1, moe_balance=balance, tie_embeddings=False,
        )
    )  # fmt: skip
    validate_moe(cfg)
    return cfg


def _perturbed(cfg: ModelConfig) -> torch.nn.Module:
    """Seeded weights moved off their init (LaX's gates start at zero)."""
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _case(rank: int, world: int, arch: str, balance: str, grouping: bool, ckpt: str) -> dict:
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(tp=world, device=device.type), device)
    cfg = _cfg(arch, balance)
    ref = _perturbed(cfg).to(device)
    ref.train()
    ctx = TPContext(comms.tp, cfg, grouping=grouping, act_ckpt=ckpt)
    part = sliced(copy.deepcopy(ref), "btp", ctx)
    part.train()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    comms.ledger.reset()
    loss = part(inputs, targets=targets)
    loss.backward()
    sum_moe_grads_over_tp(part.model, comms.tp)  # as the engine's step, once
    ref_loss = ref(inputs, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)

    exact = float64_grads(ref, inputs, targets)
    got, single, want = {}, {}, {}
    for (name, p), (_, p_ref) in zip(
        part.model.named_parameters(), ref.named_parameters(), strict=True
    ):
        spec, tp = part.specs[name], comms.tp.size
        got[name] = p.grad
        single[name] = shard_tensor(p_ref.grad, spec, comms.tp.rank, tp)
        want[name] = shard_tensor(exact[name], spec, comms.tp.rank, tp)
    assert any(".mlp.experts." in n for n in got) and any(".mlp.router." in n for n in got)
    bound = layout_bound(max(relative_error(single[n], want[n]) for n in want))
    errors = {n: relative_error(got[n], want[n]) for n in want}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < bound, (arch, worst, errors[worst], bound)
    # Loads and balance biases stay equal over TP: every rank routed every token (the block's
    # re-forward routes them again, doubling every load alike).
    forwards = 2 if ckpt == "block" else 1
    for (name, buf), (_, ref_buf) in zip(
        part.model.named_buffers(), ref.named_buffers(), strict=True
    ):
        assert torch.equal(buf, ref_buf * (forwards if name.endswith(".load") else 1)), name
    records = [(r.op, r.phase, r.tag, r.elements, r.bytes) for r in comms.ledger.records]
    partial = sum(p.numel() for p in tp_partial_params(part.model))
    return {"records": records, "worst": errors[worst], "partial": partial}


def _run(rank: int, world: int) -> list[dict]:
    reports = [_case(rank, world, *case) for case in CASES]
    # A micro-batch whose tokens tp does not divide is refused by name, on every rank alike
    # (before any collective of the MoE block).
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(tp=world, device=device.type), device)
    cfg = _cfg("cola", "bias")
    part = sliced(_perturbed(cfg).to(device), "btp", TPContext(comms.tp, cfg))
    odd = torch.zeros(1, 2 * world + 1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="make batch x sequence length a multiple of tp"):
        part(odd)
    return reports


def test_btp_moe_model_equals_one_device_and_routing_adds_no_collective() -> None:
    cfg = _cfg("cola", "bias")
    tokens, r, experts = BATCH * SEQ, cfg.rank, cfg.moe_experts
    moe_blocks = cfg.n_layers - cfg.moe_dense_layers
    reports = run_distributed(_run, 2, timeout_s=300)
    for (_, _, grouping, _), report in zip(CASES, reports[0], strict=True):
        fwd = [rec[:4] for rec in report["records"] if rec[1] == "fwd"]
        reduce_tags = [tag for op, _, tag, _ in fwd if op == "all_reduce"]
        assert not any("router" in tag or tag.startswith("moe") for tag in reduce_tags)
        if grouping:
            # [p_g | p_u | logits | Σx²] in the readers' one all-reduce, per MoE block.
            dense = tokens * (2 * r + 1)
            moe_reads = [n for _, _, tag, n in fwd if tag == "gate_up" and n != dense]
            assert moe_reads == [tokens * (2 * r + experts + 1)] * moe_blocks
        # The MoE block's down-projection all-reduce is gone; the r-wide all-gather replaces it.
        assert reduce_tags.count("down_proj") == cfg.moe_dense_layers
        gathers = [n for op, _, tag, n in fwd if op == "all_gather" and tag == COMBINED_TAG]
        assert gathers == [tokens * r] * moe_blocks
        bwd = [tag for op, phase, tag, *_ in report["records"] if phase == "bwd"]
        assert bwd.count(LATENT_TAG) == moe_blocks
        # The routers', routed and shared experts' weight gradients of every MoE block: one
        # fp32 all-reduce of all of them, once per step, none in the backward itself.
        summed = [(n, b) for _, _, tag, n, b in report["records"] if tag.startswith(GRAD_TAG)]
        assert summed == [(report["partial"], 4 * report["partial"])], summed
