"""The engine's build at dp 2 x ep 2 and dp 4 x ep 2: each rank draws only its experts' rows
(equal to the one-device init's rows), and one step's loss, every gradient and the gradient
norm equal one device's within the fp32 noise bound once
:meth:`ParallelModel.reduce_expert_gradients` has run. At dp 2 x ep 2 (``dp_rep`` 1) the
experts stay whole on their ep rank, FSDP leaves them alone; at dp 4 x ep 2 they are FSDP
units over ``dp_rep`` inside their blocks, so a rank holds 1/dp of the routed experts'
weights, gradients and AdamW state.

The trainer's whole path (``boostlr train --parallel.ep``) is checked in
tests/test_moe_ep_train.py; this checks the pieces it is assembled from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_distributed
from fp32_noise import float64_grads, layout_bound, relative_error
from parallel_cases import full_grad, global_batch, layout_config
from torch.distributed.tensor import DTensor, Shard

from boostlr.config import RunConfig
from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel
from boostlr.specs.moe import is_routed_expert
from boostlr.train.optim import build_optimizer

cpu = torch.device("cpu")
MOE = {
    "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32,
    "model.moe_shared": 1, "model.moe_balance": "aux",
}  # fmt: skip


def _config(arch: str, dp: int, ep: int, mode: str = "fsdp") -> RunConfig:
    cfg = layout_config(arch, "auto", 1, dp, 1, **MOE, **{"parallel.dp_mode": mode})
    # layout_config takes no parallel.ep: set it on the built config.
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))


def _build_checks(rank: int, world: int, arch: str, ep: int, mode: str) -> dict[str, int]:
    cfg = _config(arch, world, ep, mode)
    model = ParallelModel.build(cfg, cpu)
    ref = build_model(cfg.model, seed=cfg.train.seed)
    init = dict(ref.named_parameters())
    per = cfg.model.moe_experts // ep
    experts = 0
    for name, p in model.named_parameters():
        if is_routed_expert(name):
            experts += 1
            assert isinstance(p, DTensor), name
            if ep == world:  # whole on its ep rank
                assert p.placements == (Shard(0),), name
                assert p.device_mesh.mesh_dim_names == ("ep",)
                rows = init[name].detach()[rank % ep * per : (rank % ep + 1) * per]
                assert torch.equal(p.to_local(), rows), name
            else:  # FSDP's dp_rep shard of the ep shard
                assert p.device_mesh.mesh_dim_names == ("dp_rep", "ep"), name
            assert torch.equal(p.full_tensor(), init[name].detach()), name
    inputs, targets = global_batch(cfg)
    b = cfg.train.batch_size
    mine = slice(rank * b, (rank + 1) * b)
    loss = model.global_mean(model.forward_backward(inputs[mine], targets[mine]))
    model.reduce_expert_gradients()
    ledger = model.comms.ledger.totals("ep")
    grads = {n: full_grad(p).clone() for n, p in model.named_parameters()}
    with CollectiveCount() as count:
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
    return {"experts": experts, "ep_calls": ledger["calls"], "norm_reductions": count.calls}


class CollectiveCount:
    """All-reduces issued inside the block, DTensor's (functional) and plain ones alike, as
    the profiler records their ops."""

    def __enter__(self) -> CollectiveCount:
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profile.__exit__(*exc)
        names = [e.name for e in self.profile.events()]
        self.calls = names.count("c10d::allreduce_")  # under a functional one too


@pytest.mark.parametrize(("dp", "ep", "mode"), [(2, 2, "fsdp"), (4, 2, "fsdp"), (4, 2, "ddp")])
def test_build_and_one_step_equal_one_device(dp: int, ep: int, mode: str) -> None:
    """``ddp``: the expert units stay gathered from forward to backward (ZeRO-2), as blocks.

    The gradient norm takes one all-reduce per mesh: the dense gradients' over dp, and the
    experts' over their ``dp_rep x ep`` ranks in one (DTensor alone runs one per mesh dim)."""
    got = run_distributed(_build_checks, dp, "cola", ep, mode, timeout_s=300)
    # 2 MoE blocks x 3 stacked latent-expert weights; the dispatch went over ep.
    assert all(r["experts"] == 6 and r["ep_calls"] > 0 for r in got)
    assert all(r["norm_reductions"] == 2 for r in got), got


def _expert_state(rank: int, world: int, ep: int) -> dict[str, int]:
    """Bytes of the routed experts this rank holds after one AdamW step: weights, gradients,
    AdamW's two moments; and the whole model's routed-expert bytes."""
    cfg = _config("cola", world, ep)
    model = ParallelModel.build(cfg, cpu)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    inputs, targets = global_batch(cfg)
    b = cfg.train.batch_size
    model.forward_backward(inputs[rank * b : (rank + 1) * b], targets[rank * b : (rank + 1) * b])
    model.reduce_expert_gradients()
    optimizer.step()

    def held(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    out = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    for name, p in model.named_parameters():
        if is_routed_expert(name):
            out["params"] += held(p)
            out["grads"] += held(p.grad)
            out["optimizer"] += sum(held(optimizer.state[p][k]) for k in ("exp_avg", "exp_avg_sq"))
            out["total"] += p.numel() * p.element_size()
    return out


def test_a_rank_holds_one_dp_th_of_the_expert_state_at_dp4_ep2() -> None:
    """E 4 over ep 2, each ep shard's 2 experts over dp_rep 2: weights, gradients and both
    AdamW moments of the routed experts, 1/4 of the whole on every rank."""
    for got in run_distributed(_expert_state, 4, 2, timeout_s=300):
        quarter = got["total"] // 4
        assert got["params"] == got["grads"] == quarter, got
        assert got["optimizer"] == 2 * quarter, got


def _norm_reductions_of_a_later_model(rank: int, world: int) -> list[int]:
    """The clip's all-reduces of each of three models built one after another in one process
    (as a benchmark builds its variants): torch may place a later model's experts on an
    earlier model's groups over the same ranks."""
    counts = []
    for arch in ("full", "cola", "cola"):
        cfg = _config(arch, world, 2)
        model = ParallelModel.build(cfg, cpu)
        inputs, targets = global_batch(cfg)
        b = cfg.train.batch_size
        mine = slice(rank * b, (rank + 1) * b)
        model.global_mean(model.forward_backward(inputs[mine], targets[mine]))
        model.reduce_expert_gradients()
        with CollectiveCount() as count:
            model.clip_gradients(0.0)
        counts.append(count.calls)
    return counts


def test_every_model_in_a_process_norms_its_experts_in_one_all_reduce() -> None:
    """dp 4 x ep 2: the experts' one-all-reduce norm is decided from their mesh's ranks, so a
    third model whose experts sit on the second one's groups still takes it."""
    for got in run_distributed(_norm_reductions_of_a_later_model, 4, timeout_s=300):
        assert got == [2, 2, 2], got
