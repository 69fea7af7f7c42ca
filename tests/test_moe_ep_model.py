"""A whole MoE model with its experts spread over ep equals one device: loss and every
gradient within the fp32 noise bound (tests/fp32_noise.py), on real gloo ranks.

No FSDP here (the trainer's path: tests/test_moe_ep_train.py): each rank holds the whole
model but only its ep shard of the experts and runs its own slice of the batch. The rule the
trainer must implement is what this test applies by hand: a non-expert gradient is the dp
mean of the ranks' gradients (what FSDP's reduction gives); an expert shard's gradient is
its rank's gradient summed over ``dp_rep`` and divided by dp, since the all-to-all's backward
has already summed the ep group's contributions into it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import rank_device, run_distributed
from fp32_noise import float64_grads, layout_bound, relative_error
from torch.distributed.tensor import DTensor

from boostlr.config import ModelConfig, ParallelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models.llama import build_model
from boostlr.parallel.expert_parallel import shard_experts
from boostlr.parallel.mesh import build_mesh

PER_RANK = 2  # sequences


def _cfg(arch: str, balance: str) -> ModelConfig:
    cfg = resolve_model(
        ModelConfig(
            preset="tiny", arch=arch, dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, n_layers=3,
            rank=4, moe_experts=4, moe_top_k=2, moe_ffn_dim=8, vocab_size=32,
            moe_dense_layers=1, moe_shared=1, moe_balance=balance,
        )
    )  # fmt: skip
    validate_moe(cfg)
    return cfg


def _model_checks(rank: int, world: int, ep: int, arch: str, balance: str) -> float:
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(dp=world, ep=ep, device=device.type), device)
    cfg = _cfg(arch, balance)
    ref = build_model(cfg, seed=0).to(device)
    model = copy.deepcopy(ref)
    shard_experts(model, comms)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (world * PER_RANK, 9), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    loss = model(inputs[mine], targets[mine])
    loss.backward()
    ref_loss = ref(inputs, targets)
    ref_loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=0)

    exact = float64_grads(ref, inputs, targets)
    per, at = cfg.moe_experts // ep, rank % ep
    got, single, want = {}, {}, {}
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if isinstance(p, DTensor):
            assert ".mlp.experts." in name
            rows = slice(at * per, (at + 1) * per)
            g = p.grad.to_local().clone()
            dist.all_reduce(g, group=comms.group("dp_rep").group)
            got[name], single[name], want[name] = g / world, p_ref.grad[rows], exact[name][rows]
        else:
            assert ".mlp.experts." not in name
            g = p.grad.clone()
            dist.all_reduce(g)
            got[name], single[name], want[name] = g / world, p_ref.grad, exact[name]
    assert any(".mlp.experts." in n for n in got)
    bound = layout_bound(max(relative_error(single[n], want[n]) for n in want))
    worst = max(relative_error(got[n], want[n]) for n in want)
    assert worst < bound, (worst, bound)
    return worst


@pytest.mark.parametrize(
    ("world", "ep", "arch", "balance"),
    [(2, 2, "cola", "bias"), (2, 2, "lax", "aux"), (4, 2, "svd", "aux"), (4, 4, "cola", "bias")],
)
def test_ep_model_equals_one_device(world: int, ep: int, arch: str, balance: str) -> None:
    run_distributed(_model_checks, world, ep, arch, balance, timeout_s=240)
