"""The bf16 precision contract of docs/precision.md, the same at every layout.

* dp 2 and dp 1 compute the same numbers under ``train.dtype bfloat16``: both keep the
  residual stream fp32 and use every parameter as its bf16 copy, so the loss of one batch
  from identical weights differs only by the order of fp32 sums, as in float32 (FSDP's
  default policy cast every block's input, the residual, to bf16 at dp > 1 only), and the
  gradients are as close to each other, relative to the one-device run's own error against
  float64, as the float32 ones are.
* BTP's norm statistics keep fp32 precision inside the partials' single bf16 all-reduce
  (the hi/lo pair), checked on a real gloo bf16 all-reduce against the fp32 sum.
* The fused cross-entropy's gradient of a confident token survives bf16 (computed in fp32,
  rounded once), as the unfused path's does.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from fp32_noise import NOISE_FLOOR, relative_error
from parallel_cases import full_grad, global_batch, layout_config

from boostlr.models.llama import build_model
from boostlr.parallel.btp import join_stats, split_stats, stats_hi_bits
from boostlr.parallel.build import build_stages
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.head_loss import head_cross_entropy
from boostlr.parallel.mesh import single_process_comms
from boostlr.parallel.vocab import vocab_split

cpu = torch.device("cpu")
LOSS_TOL = 1e-5  # the fp32 layout tolerance of test_parallel_3d: reduction order only
CASES = [("cola", "btp"), ("lax", "btp"), ("full", "megatron")]
# Gradients: how much further apart dp 2 and dp 1 may be in bf16 than in fp32, each in units
# of its own dtype's one-device error against float64 (dp 2 rounds two half-batch weight
# gradients to bf16 where dp 1 rounds one: a difference of the size of that error).
GRAD_FACTOR = 4.0


def _record_block_inputs(model: ParallelModel) -> set[str]:
    """Dtypes of the residual each block receives (after FSDP's own pre-forward hook)."""
    seen: set[str] = set()
    for part in model.stages:
        for block in part.model.layers.values():
            block.register_forward_pre_hook(lambda _m, args: seen.add(str(args[0].dtype)))
    return seen


def _one_step(model: ParallelModel, inputs, targets, autocast) -> tuple[float, dict]:
    with autocast:
        loss = model.forward_backward(inputs, targets)
    if model.comms.dp.size > 1:
        loss = model.global_mean(loss)
    grads = {n: full_grad(p).clone() for n, p in model.named_parameters()}
    return float(loss), grads


def dp2_and_dp1(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """For each arch and dtype: one step at dp 2 and at dp 1 from the same init, + float64."""
    out = {}
    for (arch, strategy), dtype in [(c, d) for c in cases for d in ("float32", "bfloat16")]:
        cfg2 = layout_config(arch, strategy, 1, 2, 1, **{"train.dtype": dtype})
        cfg1 = layout_config(arch, strategy, 1, 1, 1, **{"train.dtype": dtype})
        bf16 = dtype == "bfloat16"
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        inputs, targets = global_batch(cfg2)
        b = cfg2.train.batch_size
        dp2 = ParallelModel.build(cfg2, cpu)
        seen2 = _record_block_inputs(dp2)
        mine = slice(dp2.comms.dp.rank * b, (dp2.comms.dp.rank + 1) * b)
        loss2, grads2 = _one_step(dp2, inputs[mine], targets[mine], autocast)
        comms = single_process_comms()  # the trainer's one-device model, in this process
        cfg1.train.batch_size = 2 * b
        dp1 = ParallelModel(cfg1, comms, build_stages(cfg1, comms, torch.device("cpu"), 0), cpu)
        seen1 = _record_block_inputs(dp1)
        loss1, grads1 = _one_step(dp1, inputs, targets, autocast)
        exact = build_model(cfg1.model, seed=cfg1.train.seed).double()
        exact(inputs, targets).backward()
        exact_grads = {n: p.grad for n, p in exact.named_parameters()}
        out[(arch, strategy, dtype)] = {
            "loss_diff": abs(loss2 - loss1) / abs(loss1),
            "grad_diff": max(relative_error(grads2[n], g) for n, g in grads1.items()),
            "noise": max(relative_error(g, exact_grads[n]) for n, g in grads1.items()),
            "block_inputs": (seen2, seen1),
        }
    return out


def test_dp2_and_dp1_agree_in_bf16_as_closely_as_in_fp32() -> None:
    results = run_distributed(dp2_and_dp1, 2, CASES, timeout_s=600)[0]
    for arch, strategy in CASES:
        f32 = results[(arch, strategy, "float32")]
        b16 = results[(arch, strategy, "bfloat16")]
        for r in (f32, b16):  # the residual stream reaches every block in fp32, at dp 2 and 1
            assert r["block_inputs"] == ({"torch.float32"}, {"torch.float32"}), (arch, r)
        # The loss: the same per-token numbers, summed in another order, in either dtype.
        assert f32["loss_diff"] <= LOSS_TOL and b16["loss_diff"] <= LOSS_TOL, (arch, f32, b16)
        # The gradients, each dtype measured against its own one-device error.
        ratio32 = f32["grad_diff"] / max(f32["noise"], NOISE_FLOOR)
        ratio16 = b16["grad_diff"] / b16["noise"]
        assert ratio16 <= GRAD_FACTOR * max(ratio32, 1.0), (arch, ratio16, ratio32, f32, b16)


def bf16_stats(rank: int, world: int, spreads: list[float]) -> dict:
    return {spread: _bf16_stats(rank, world, spread) for spread in spreads}


def _bf16_stats(rank: int, world: int, spread: float) -> dict:
    """Σx² of each rank's slice (up to ``spread`` apart between ranks, over a wide range of
    magnitudes) summed by a real bf16 all-reduce, as a plain bf16 column and as the pair."""
    tokens = 512
    magnitude = 10.0 ** torch.randint(
        -6, 6, (tokens, 1), generator=torch.Generator().manual_seed(9)
    )
    gen = torch.Generator().manual_seed(rank)
    ss = magnitude * (1 + (spread - 1) * torch.rand(tokens, 1, generator=gen))
    exact = ss.double().clone()
    dist.all_reduce(exact)
    plain = ss.to(torch.bfloat16)
    dist.all_reduce(plain)
    pair = split_stats(ss, torch.bfloat16, world)
    assert pair.dtype == torch.bfloat16 and pair.shape == (tokens, 2)
    dist.all_reduce(pair)
    return {
        "plain": ((plain.double() - exact).abs() / exact).max().item(),
        "pair": ((join_stats(pair).double() - exact).abs() / exact).max().item(),
        "fp32_is_itself": split_stats(ss, torch.float32, world) is ss,
    }


def test_norm_statistics_keep_their_precision_in_the_bf16_all_reduce() -> None:
    for world, spreads in ((2, [4.0, 1000.0]), (4, [4.0])):
        for report in run_distributed(bf16_stats, world, spreads, timeout_s=300):
            r = report[4.0]
            assert r["fp32_is_itself"]
            # Slices within 4x: the hi parts add up exactly, lo carries 8 more bits.
            assert r["pair"] <= 2.0 ** -(stats_hi_bits(world) + 8), (world, r)
            assert r["pair"] * 8 < r["plain"], (world, r)  # bf16 alone: ~2^-9 per rounding
            # Far apart (one slice holds the outlier channels): never worse than one rounding.
            for r in (report[s] for s in spreads if s != 4.0):
                assert r["pair"] <= 2.0**-8 and r["pair"] <= r["plain"], (world, r)


def test_split_statistics_pass_gradients_to_the_sum_of_squares() -> None:
    ss = (torch.rand(16, 1) * 100).requires_grad_()
    weight = torch.randn(16, 1)
    (join_stats(split_stats(ss, torch.bfloat16, 2)) * weight).sum().backward()
    torch.testing.assert_close(ss.grad, weight.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_fused_loss_keeps_a_confident_tokens_gradient_in_bf16() -> None:
    """p(target) = 0.999 rounds to 1 in bf16: subtracting the one-hot after rounding would
    give the target's logit no gradient at all."""
    n, d, v = 8, 16, 32
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(v, d, generator=gen) / math.sqrt(d)
    targets = torch.randint(0, v, (n,), generator=gen)
    h = 4.0 * w[targets] * math.sqrt(d) / w[targets].norm(dim=-1, keepdim=True)
    h = h.to(torch.bfloat16).float()
    w = w.to(torch.bfloat16).float()  # exact in bf16: both paths see the same GEMM operands
    grads = []
    for fused in (True, False):
        hh = h.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss = head_cross_entropy(hh, w, targets, vocab_split(v, None))
            else:
                loss = F.cross_entropy(F.linear(hh, w).float(), targets)
        loss.backward()
        grads.append(hh.grad)
    probs = torch.softmax(F.linear(h, w), -1).gather(-1, targets[:, None])
    assert ((probs.to(torch.bfloat16) == 1) & (probs < 1)).any(), probs  # confident tokens
    # The two paths differ only by where bf16 rounds the GEMM operands of the backward.
    assert relative_error(grads[0], grads[1]) < 2.0**-6, relative_error(grads[0], grads[1])


def test_parameters_are_used_as_bf16_copies_at_one_device_too() -> None:
    """dp 1 rounds a norm gain as FSDP's bf16 gather does at dp > 1 (docs/precision.md)."""
    cfg = layout_config("cola", "btp", 1, 1, 1, **{"train.dtype": "bfloat16"})
    model = build_model(cfg.model, seed=0)
    with torch.no_grad():
        for block in model.layers.values():
            block.input_layernorm.weight.add_(1e-3)  # 1.001: not a bf16 value
    inputs, targets = global_batch(cfg)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(inputs, targets).item() == rounded(inputs, targets).item()
