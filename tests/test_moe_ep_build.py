"""The engine's build at dp 2 x ep 2: each rank draws only its experts' rows (equal to the
one-device init's rows), FSDP leaves them alone, and one step's loss, every gradient and
the gradient norm equal one device's within the fp32 noise bound once
:meth:`ParallelModel.reduce_expert_gradients` has run.

The trainer's whole path (``boostlr train --parallel.ep``) is checked in
tests/test_moe_ep_train.py; this checks the pieces it is assembled from.
"""

from __future__ import annotations

import dataclasses

import torch
from distributed import run_distributed
from fp32_noise import float64_grads, layout_bound, relative_error
from parallel_cases import full_grad, global_batch, layout_config
from torch.distributed.tensor import DTensor, Shard

from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel
from boostlr.specs.moe import is_routed_expert

cpu = torch.device("cpu")
MOE = {
    "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32,
    "model.moe_shared": 1, "model.moe_balance": "aux",
}  # fmt: skip


def _build_checks(rank: int, world: int, arch: str) -> dict[str, int]:
    cfg = layout_config(arch, "auto", 1, world, 1, **MOE)
    # layout_config takes no parallel.ep: set it on the built config.
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=world))
    model = ParallelModel.build(cfg, cpu)
    ref = build_model(cfg.model, seed=cfg.train.seed)
    init = dict(ref.named_parameters())
    per = cfg.model.moe_experts // world
    experts = 0
    for name, p in model.named_parameters():
        if is_routed_expert(name):
            experts += 1
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            assert p.device_mesh.mesh_dim_names == ("ep",)
            rows = init[name].detach()[rank * per : (rank + 1) * per]
            assert torch.equal(p.to_local(), rows), name
    inputs, targets = global_batch(cfg)
    b = cfg.train.batch_size
    mine = slice(rank * b, (rank + 1) * b)
    loss = model.global_mean(model.forward_backward(inputs[mine], targets[mine]))
    model.reduce_expert_gradients()
    ledger = model.comms.ledger.totals("ep")
    grads = {n: full_grad(p).clone() for n, p in model.named_parameters()}
    norm = model.clip_gradients(0.0)  # the norm only: each expert shard counted once

    ref_loss = ref(inputs, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    exact = float64_grads(ref, inputs, targets)
    single = {n: p.grad for n, p in ref.named_parameters()}
    bound = layout_bound(max(relative_error(g, exact[n]) for n, g in single.items()))
    worst = max(relative_error(g, exact[n]) for n, g in grads.items())
    assert set(grads) == set(single) and worst < bound, (worst, bound)
    ref_norm = torch.nn.utils.get_total_norm(list(single.values()))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    return {"experts": experts, "ep_calls": ledger["calls"]}


def test_dp2_ep2_build_and_one_step_equal_one_device() -> None:
    got = run_distributed(_build_checks, 2, "cola", timeout_s=240)
    # 2 MoE blocks x 3 stacked latent-expert weights; the dispatch went over ep.
    assert all(r["experts"] == 6 and r["ep_calls"] > 0 for r in got)
