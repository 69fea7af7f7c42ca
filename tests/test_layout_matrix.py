"""Every arch x every layout family x float32/bfloat16 against one device, a few steps each.

Archs: full (megatron), svd, cola, lax (btp) and cola under vanilla. Layout families: tp2,
dp2, pp2, the interleaved pipeline, pp2 x tp2, pp2 x dp2, dp2 x tp2 and pp2 x dp2 x tp2 with
both dp modes. Every step starts from identical weights (the single-device model takes the
layout's current weights first), so no check compares two diverging trajectories.

* float32: the loss and the gradient norm to 1e-5 relative, the gradients within
  :func:`fp32_noise.layout_bound` of float64 (the single device's own fp32 error, measured).
* bfloat16: the same rule with the one-device *bf16* run as the yardstick. At every step the
  one-device bf16 model's own gradient error against float64 is measured, and the layout's
  may be :data:`fp32_noise.BF16_FACTOR` times it (the gradient norm likewise). Both runs
  round the same quantities to 8 bits (docs/precision.md) in another order, so their errors
  are of one size; a wrong slice, a missing reduction or a garbled boundary is off by far
  more. The loss, a mean of fp32 log-softmaxes of bf16 logits, must agree with the one-device
  bf16 loss to one bf16 rounding (:data:`BF16_LOSS_TOL`). Whether a layout keeps what the
  contract keeps in fp32 is tested where it shows: tests/test_precision.py.

Worlds of 2, 4 and 8 ranks each run their whole share of the matrix in one process group
(a fresh mesh per configuration): spawning is the expensive part on CI's two cores.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import nullcontext

import pytest
import torch
from distributed import run_distributed
from fp32_noise import BF16_FACTOR, bf16_layout_bound, layout_bound, relative_error
from parallel_cases import _gather_full_weights, full_grad, global_batch, layout_config

from boostlr.analysis.comm import pp_send_bytes
from boostlr.analysis.moe import routed_widths
from boostlr.config import build_config
from boostlr.errors import ConfigError
from boostlr.models.llama import build_model
from boostlr.models.placement import stage_layers
from boostlr.parallel.btp_moe import GRAD_TAG
from boostlr.parallel.engine import ParallelModel
from boostlr.train.optim import build_optimizer

pytestmark = pytest.mark.slow

ARCHS = [("full", "megatron"), ("svd", "btp"), ("cola", "btp"), ("lax", "btp"), ("cola", "vanilla")]
# (label, pp, dp, tp, extra): every layout family the config accepts.
LAYOUTS = {
    2: [
        ("tp2", 1, 1, 2, {}),
        ("dp2", 1, 2, 1, {}),
        ("pp2", 2, 1, 1, {}),
        ("pp2 interleaved", 2, 1, 1, {"parallel.pp_schedule": "interleaved"}),
    ],
    4: [
        ("pp2tp2", 2, 1, 2, {}),
        ("pp2dp2", 2, 2, 1, {}),
        ("dp2tp2", 1, 2, 2, {}),
    ],
    8: [
        ("pp2dp2tp2 fsdp", 2, 2, 2, {"parallel.dp_mode": "fsdp"}),
        ("pp2dp2tp2 ddp", 2, 2, 2, {"parallel.dp_mode": "ddp"}),
    ],
}
DTYPES = ("float32", "bfloat16")
STEPS = 2
LOSS_TOL = 1e-5  # fp32: |loss - loss_ref| / |loss_ref| from identical weights
# The loss's own error is a sum of many per-token roundings: one sample of it is too noisy a
# yardstick (two such samples differ by 4x one time in six), so the loss gets bf16's relative
# precision, one rounding of an 8-bit significand.
BF16_LOSS_TOL = 2.0**-8


# MoE rows (routed experts, dropless): (label, pp, dp, ep) x MOE_ARCHS x DTYPES. ``ep`` is carved
# out of dp; the experts' gradients take the trainer's rule (reduce_expert_gradients).
MOE_LAYOUTS = {
    2: [("moe dp2", 1, 2, 1), ("moe dp2ep2", 1, 2, 2), ("moe pp2", 2, 1, 1)],
    4: [("moe dp4ep2", 1, 4, 2), ("moe dp4ep4", 1, 4, 4), ("moe pp2dp2ep2", 2, 2, 2)],
}
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32}
MOE_ARCHS = [("cola", {}), ("full", {"model.moe_shared": 1, "model.moe_balance": "aux"})]
# MoE under BTP (latent dispatch): (label, pp, dp, tp, ep), cola only (full has no latent).
# At ep x tp each TP rank dispatches its share of the tokens to the ep peers of its TP rank.
MOE_TP_LAYOUTS = {
    2: [("moe tp2", 1, 1, 2, 1)],
    4: [("moe dp2tp2", 1, 2, 2, 1), ("moe pp2tp2", 2, 1, 2, 1), ("moe dp2ep2tp2", 1, 2, 2, 2)],
    8: [("moe pp2dp2ep2tp2", 2, 2, 2, 2)],
}

# A capacity at ep > 1 (fixed-shape all-to-alls), and under a pipeline: capacity per forward,
# so its one device runs each dp rank's share of the batch, and under a pipeline each
# pipeline micro-batch of it, as a forward of its own (what the trainer's forwards are).
MOE_CAPACITY_LAYOUTS = {
    2: [("moe dp2ep2 capacity", 1, 2, 2), ("moe pp2 capacity", 2, 1, 1)],
    4: [("moe pp2dp2ep2 capacity", 2, 2, 2)],
}
CAPACITY = 1.0


# LaX MoE under a pipeline (latent dispatch): (label, pp, dp, tp, ep, extra). A stage boundary
# carries the latents the next block reads: an MoE block's B_d takes no crossing, so no
# ``down_proj`` latent crosses into one; the dense-first row has a boundary into a dense block.
MOE_LAX_LAYOUTS = {
    2: [("moe pp2", 2, 1, 1, 1, {}), ("moe pp2 dense3", 2, 1, 1, 1, {"model.moe_dense_layers": 3})],
    4: [("moe pp2tp2", 2, 1, 2, 1, {}), ("moe pp2dp2ep2", 2, 2, 1, 2, {})],
}


def moe_cases(world: int) -> list[tuple[str, object]]:
    cases = []
    for (name, pp, dp, tp, ep, extra), dtype in itertools.product(
        MOE_LAX_LAYOUTS.get(world, []), DTYPES
    ):
        keys = {**MOE, **extra, "parallel.ep": ep, "train.dtype": dtype}
        cases.append((f"{name} lax btp {dtype}", layout_config("lax", "btp", pp, dp, tp, **keys)))
    for (name, pp, dp, ep), (arch, extra), dtype in itertools.product(
        MOE_LAYOUTS.get(world, []), MOE_ARCHS, DTYPES
    ):
        keys = {**MOE, **extra, "parallel.ep": ep, "train.dtype": dtype}
        cases.append((f"{name} {arch} {dtype}", layout_config(arch, "auto", pp, dp, 1, **keys)))
    for (name, pp, dp, tp, ep), dtype in itertools.product(MOE_TP_LAYOUTS[world], DTYPES):
        keys = {**MOE, "model.moe_shared": 1, "parallel.ep": ep, "train.dtype": dtype}
        cases.append((f"{name} cola btp {dtype}", layout_config("cola", "btp", pp, dp, tp, **keys)))
    for name, pp, dp, ep in MOE_CAPACITY_LAYOUTS.get(world, []):
        keys = {**MOE, "parallel.ep": ep, "model.moe_capacity": CAPACITY}
        cases.append((f"{name} cola float32", layout_config("cola", "auto", pp, dp, 1, **keys)))
    return cases


def matrix_cases(world: int) -> list[tuple[str, object]]:
    cases = []
    for (name, pp, dp, tp, extra), (arch, strategy), dtype in itertools.product(
        LAYOUTS[world], ARCHS, DTYPES
    ):
        cfg = layout_config(arch, strategy, pp, dp, tp, **{"train.dtype": dtype, **extra})
        cases.append((f"{name} {arch} {strategy} {dtype}", cfg))
    return cases


def _exact(
    ref: torch.nn.Module, inputs, targets, shares: int = 1
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of a float64 copy of the single-device model."""
    exact = copy.deepcopy(ref).double()
    exact.zero_grad(set_to_none=True)
    loss = _one_device_loss(exact, inputs, targets, shares)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in exact.named_parameters()}


def _one_device_loss(ref: torch.nn.Module, inputs, targets, shares: int) -> torch.Tensor:
    """The mean loss of the batch, as ``shares`` forwards of equal row blocks (for a
    capacity, which drops per forward: one per dp rank and pipeline micro-batch) or one."""
    rows = inputs.shape[0] // shares
    losses = [ref(inputs[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows])
              for i in range(shares)]  # fmt: skip
    return sum(losses) / shares


def follow(cfg, steps: int) -> dict:
    """``steps`` clipped AdamW steps of the layout, each against one device (same dtype)."""
    model = ParallelModel.build(cfg, torch.device("cpu"))
    opt = build_optimizer(model.parameters(), cfg.train, fused=False)
    ref = build_model(cfg.model, seed=cfg.train.seed)
    ref_params = dict(ref.named_parameters())
    bf16 = cfg.train.dtype == "bfloat16"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    b, dp_rank = cfg.train.batch_size, model.comms.dp.rank
    mine = slice(dp_rank * b, (dp_rank + 1) * b)
    inputs, targets = global_batch(cfg)  # one batch throughout: the loss must fall
    par = cfg.parallel
    forwards = par.dp * (par.pp_microbatches if par.pp > 1 else 1)  # the trainer's per step
    shares = forwards if cfg.model.moe_capacity else 1
    report: dict = {"steps": []}
    for step in range(steps):
        if step:  # before the first step both hold the seeded init (layout-free by design)
            weights = _gather_full_weights(model)
            with torch.no_grad():
                for name, p in ref_params.items():
                    p.copy_(weights[name])
        ref.zero_grad()
        with autocast:
            ref_loss = _one_device_loss(ref, inputs, targets, shares)
        ref_loss.backward()
        ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref_params.values()))
        loss64, exact = _exact(ref, inputs, targets, shares)

        opt.zero_grad()
        model.comms.ledger.reset()
        with autocast:
            loss = float(model.global_mean(model.forward_backward(inputs[mine], targets[mine])))
        model.reduce_expert_gradients()  # as the trainer's step (no collective at ep 1)
        pp_bytes = model.step_metrics()["comm_pp_bytes"]
        records = model.comms.ledger.records
        tp_sums = [(r.bytes, r.elements) for r in records if r.tag == GRAD_TAG]
        # Each forward payload all-to-all pair's dispatch (whole input: the rank's copies).
        moe_fwd = [
            r.bytes for r in records if r.group == "ep" and r.tag == "moe" and r.phase == "fwd"
        ]
        layout64 = max(relative_error(full_grad(p), exact[n]) for n, p in model.named_parameters())
        single64 = max(relative_error(p.grad, exact[n]) for n, p in ref_params.items())
        grad_dtypes = {str(full_grad(p).dtype) for _, p in model.named_parameters()}
        norm = float(model.clip_gradients(cfg.train.grad_clip))
        opt.step()
        report["steps"].append(
            {
                "loss": loss,
                "ref_loss": ref_loss.item(),
                "loss64": loss64,
                "norm": norm,
                "ref_norm": ref_norm.item(),
                "layout64": layout64,
                "single64": single64,
                "pp_bytes": pp_bytes,
                "tp_sums": tp_sums,
                "dispatch": moe_fwd[::2],
                "grad_dtypes": grad_dtypes,
            }
        )
    if cfg.model.moe_experts and cfg.parallel.pp > 1:  # evaluate runs its own stage sends
        weights = _gather_full_weights(model)
        with torch.no_grad():
            for name, p in ref_params.items():
                p.copy_(weights[name])
            evaluated = par.dp if cfg.model.moe_capacity else 1  # a forward per rank's rows
            with autocast:
                ref_eval = _one_device_loss(ref, inputs, targets, evaluated).item()
        report["eval"] = (model.evaluate([(inputs[mine], targets[mine])], autocast), ref_eval)
    report["param_dtypes"] = {str(p.dtype) for p in model.parameters()}
    report["pp_rank"] = model.comms.pp.rank
    return report


def run_matrix(rank: int, world: int, cases: list[tuple[str, object]]) -> dict:
    return {label: follow(cfg, STEPS) for label, cfg in cases}


def check(label: str, cfg, report: dict) -> None:
    bf16 = cfg.train.dtype == "bfloat16"
    assert report["param_dtypes"] == {"torch.float32"}, (label, report["param_dtypes"])
    steps = report["steps"]
    for s in steps:
        assert s["grad_dtypes"] == {"torch.float32"}, (label, s["grad_dtypes"])
        if bf16:
            bound = bf16_layout_bound(s["single64"])
            # Routed experts under bf16: a rounding that another kernel shape makes
            # differently can flip a near-tie token's expert (against float64 too), which
            # moves that expert's gradient far beyond rounding; whether the one-device run
            # flips at a step is chance. So its rows check the loss and the gradient norm
            # here, the gradients in their fp32 rows.
            if not cfg.model.moe_experts:
                assert s["layout64"] <= bound, (label, "gradients", s["layout64"], s["single64"])
            assert abs(s["loss"] - s["ref_loss"]) <= BF16_LOSS_TOL * abs(s["ref_loss"]), (label, s)
            assert abs(s["norm"] - s["ref_norm"]) <= BF16_FACTOR * s["single64"] * s["ref_norm"]
        else:
            assert abs(s["loss"] - s["ref_loss"]) <= LOSS_TOL * abs(s["ref_loss"]), (label, s)
            assert abs(s["norm"] - s["ref_norm"]) <= LOSS_TOL * s["ref_norm"], (label, s)
            assert s["layout64"] <= layout_bound(s["single64"]), (label, s)
    assert steps[-1]["loss"] < steps[0]["loss"], (label, [s["loss"] for s in steps])
    p, m = cfg.parallel, cfg.model
    if m.moe_experts and p.tp > 1:
        # The MoE gradients each TP rank holds a part of: summed once per step, in fp32.
        for sums in (s["tp_sums"] for s in steps):
            assert len(sums) == 1 and sums[0][0] == 4 * sums[0][1], (label, sums)
    if m.moe_experts and p.ep > 1 and p.pp == 1 and not m.moe_capacity:
        # Each (TP rank's share of the) micro-batch's copies leave in the compute dtype.
        copies = cfg.train.batch_size * cfg.data.seq_len // p.tp * m.moe_top_k
        w_d, e_d, _, _ = routed_widths(m, 2 if bf16 else 4)
        want = copies * w_d * e_d
        assert all(s["dispatch"] == [want] * len(s["dispatch"]) for s in steps), (label, want)
        assert steps[0]["dispatch"], label
    if "eval" in report:
        got, want = report["eval"]
        assert abs(got - want) <= (BF16_LOSS_TOL if bf16 else LOSS_TOL) * abs(want), (label, got)
    p, m = cfg.parallel, cfg.model
    if p.pp > 1 and p.virtual_stages == 1:  # what crossed the stage boundary, as declared
        pp_rank = report["pp_rank"]
        expected = pp_send_bytes(
            m,
            p.strategy_for(m.arch),
            p.tp,
            cfg.train.batch_size // p.pp_microbatches * cfg.data.seq_len,
            p.pp_microbatches,
            first=pp_rank == 0,
            last=pp_rank == p.pp - 1,
            act_size=2 if bf16 else 4,
            layers=stage_layers(m.n_layers, p.num_stages, pp_rank),
        )
        assert steps[-1]["pp_bytes"] == expected, (label, steps[-1]["pp_bytes"], expected)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_arch_and_dtype_matches_one_device(world: int) -> None:
    run_and_check(matrix_cases(world), world)


@pytest.mark.parametrize("world", sorted(MOE_TP_LAYOUTS))
def test_moe_layouts_match_one_device(world: int) -> None:
    run_and_check(moe_cases(world), world)


def run_and_check(cases: list[tuple[str, object]], world: int) -> None:
    """Every case on ``world`` real ranks, each rank's report checked against one device."""
    per_rank = run_distributed(run_matrix, world, cases, timeout_s=900)
    configs = dict(cases)
    for reports in per_rank:
        assert set(reports) == set(configs)
        for label, report in reports.items():
            check(label, configs[label], report)


MOE_REFUSED = [
    ({"parallel.dp": 6, "parallel.ep": 3}, "must divide model.moe_experts 4"),
    ({"parallel.dp": 3, "parallel.ep": 2}, "parallel.ep 2 must divide parallel.dp 3"),
    ({"parallel.dp": 2, "parallel.ep": 2, "train.compile": "true"}, "needs a capacity"),
    ({"parallel.dp": 2, "parallel.ep": 2, "parallel.ep_receive_factor": 0.5}, "must be 0 (no"),
    ({"parallel.tp": 2, "parallel.tp_strategy": "vanilla"}, "runs under tp strategy btp only"),
    ({"parallel.tp": 2, "model.moe_dispatch": "hidden"}, "moe_dispatch hidden runs on the"),
]


@pytest.mark.parametrize(("keys", "message"), MOE_REFUSED)
def test_moe_layouts_that_cannot_work_exit_2_in_one_line(
    keys: dict, message: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boostlr.cli import main

    args = ["train", "--run-dir", str(tmp_path / "run"), "--quiet", "--model.preset", "tiny"]
    args += [f"--{k}={v}" for k, v in {**MOE, **keys}.items()]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


# (arch, strategy): the pairs the matrix leaves out because no layout can run them.
REFUSED = [("full", "btp"), ("full", "vanilla")] + [
    (arch, "megatron") for arch in ("svd", "cola", "lax")
]


@pytest.mark.parametrize(("arch", "strategy"), REFUSED)
def test_combinations_that_cannot_work_are_refused_in_one_line(arch: str, strategy: str) -> None:
    for _, pp, dp, tp, extra in itertools.chain(*LAYOUTS.values()):
        with pytest.raises(ConfigError) as err:
            layout_config(arch, strategy, pp, dp, tp, **extra)
        message = str(err.value)
        assert "\n" not in message and "parallel.tp_strategy" in message, message
    build_config(overrides=[("model.arch", arch)])  # the arch itself is fine
