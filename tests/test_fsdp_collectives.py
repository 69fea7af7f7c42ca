"""FSDP's copy-free gloo collectives give what torch's own calls give.

On gloo, FSDP's all-gather runs as one broadcast per rank into the output's slots and its
reduce-scatter as an in-place all-reduce of FSDP's staging buffer (gloo's own calls copy the
whole buffer). Checked on real gloo ranks: the collectives alone against
``all_gather_into_tensor``/``reduce_scatter_tensor``, and a whole dp2 FSDP step with the
in-place hooks against the same step with torch's hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed import run_distributed
from parallel_cases import full_grad, global_batch, layout_config
from torch.distributed.fsdp import FSDPModule

from boostlr.parallel.data_parallel import (
    in_place_all_gather,
    in_place_collectives,
    in_place_reduce_scatter,
    set_fsdp_collectives,
)
from boostlr.parallel.engine import ParallelModel


def _collectives(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(1000, generator=gen)
    want = torch.empty(world * 1000)
    dist.all_gather_into_tensor(want, shard)
    results = {}
    # FSDP's case (the input is a view of the output's own slot) and a separate input.
    for name, async_op in (("view", False), ("separate", True)):
        out = torch.full((world * 1000,), float("nan"))
        source = out.view(world, -1)[rank] if name == "view" else shard
        source.copy_(shard)
        work = in_place_all_gather(out, source, dist.group.WORLD, async_op)
        if work is not None:
            work.wait()
        results[f"gather_{name}"] = torch.equal(out, want)

    full = torch.randn(world * 1000, generator=gen)
    want_rs = torch.empty(1000)
    dist.reduce_scatter_tensor(want_rs, full.clone())
    for async_op in (False, True):
        out = torch.full((1000,), float("nan"))
        staging = full.clone()
        work = in_place_reduce_scatter(out, staging, dist.group.WORLD, dist.ReduceOp.SUM, async_op)
        if work is not None:
            work.wait()
        # The staging buffer is consumed: its memory is released once the slot is copied.
        results[f"staging_released_async_{async_op}"] = staging.untyped_storage().nbytes() == 0
        # Sums of ``world`` terms: only their order may differ between the two algorithms.
        results[f"scatter_async_{async_op}"] = torch.allclose(out, want_rs, rtol=1e-6, atol=1e-6)
    results["in_place_on_gloo"] = in_place_collectives(dist.group.WORLD)
    return results


def test_in_place_collectives_match_torchs_on_gloo() -> None:
    for world in (2, 3):
        for rank, result in enumerate(run_distributed(_collectives, world)):
            assert all(result.values()), (world, rank, result)


def _step_grads(model: ParallelModel, cfg) -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets = global_batch(cfg)
    b = cfg.train.batch_size
    mine = slice(model.comms.dp.rank * b, (model.comms.dp.rank + 1) * b)
    for p in model.parameters():
        p.grad = None
    loss = float(model.global_mean(model.forward_backward(inputs[mine], targets[mine])))
    return loss, {n: full_grad(p).clone() for n, p in model.named_parameters()}


def _in_place_vs_torch(rank: int, world: int, pp: int) -> dict:
    cfg = layout_config("cola", "btp", pp, 2, 1, **({"parallel.microbatches": 2} if pp > 1 else {}))
    model = ParallelModel.build(cfg, torch.device("cpu"))
    units = [m for part in model.stages for m in part.modules() if isinstance(m, FSDPModule)]
    assert units and in_place_collectives(model.comms.dp.group)
    model.comms.ledger.reset()
    loss_in_place, grads_in_place = _step_grads(model, cfg)
    before = model.step_metrics()
    set_fsdp_collectives(units, model.comms.dp, in_place=False)
    model.comms.ledger.reset()
    loss_torch, grads_torch = _step_grads(model, cfg)
    after = model.step_metrics()
    return {
        "same_loss": loss_in_place == loss_torch,
        "same_grads": all(torch.equal(grads_in_place[n], grads_torch[n]) for n in grads_torch),
        "same_ledger": before == after,
    }


def test_an_fsdp_step_with_in_place_collectives_is_bitwise_torchs() -> None:
    # dp 2: each sum has two terms, so the two algorithms agree to the bit.
    for rank, result in enumerate(run_distributed(_in_place_vs_torch, 4, 2)):
        assert all(result.values()), (rank, result)
