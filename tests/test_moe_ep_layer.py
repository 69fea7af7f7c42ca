"""The expert-parallel MoE layer equals the one-device layer (dp 2 and 4, ep 2 and 4, gloo).

Each rank routes its own tokens; its experts are a ``Shard(0)`` DTensor on the ep sub-mesh.
Summed over the ranks' losses, the outputs and every gradient must be the one-device layer's
on the concatenated tokens: the non-expert gradients once summed over dp, the expert ones
once summed over ``dp_rep`` (each shard's owner sees every copy its ep group routes to it).
float64, so any difference beyond summation order is a bug.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from distributed import rank_device, run_distributed
from torch.distributed.tensor import DTensor, Shard

from boostlr.config import ModelConfig, ParallelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models.moe import MoEMLP, make_moe_mlp
from boostlr.parallel.expert_parallel import shard_experts
from boostlr.parallel.mesh import build_mesh

TOKENS = 6  # per rank: one sequence


def _layer(dispatch: str, shared: int) -> tuple[ModelConfig, MoEMLP]:
    cfg = resolve_model(
        ModelConfig(
            preset="tiny", arch="cola", dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32,
            n_layers=2, rank=4, moe_experts=4, moe_top_k=2, moe_ffn_dim=8, vocab_size=32,
            moe_dispatch=dispatch, moe_shared=shared,
        )
    )  # fmt: skip
    validate_moe(cfg)
    layer = make_moe_mlp(cfg, 1)
    assert layer is not None
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        layer.router.expert_bias.copy_(0.2 * torch.randn(cfg.moe_experts, generator=gen))
    return cfg, layer.double()


def _ep_checks(rank: int, world: int, ep: int, dispatch: str, shared: int) -> dict[str, int]:
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(dp=world, ep=ep, device=device.type), device)
    cfg, ref = _layer(dispatch, shared)
    ref = ref.to(device)
    layer = copy.deepcopy(ref)
    shard_experts(layer, comms)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(world, TOKENS, cfg.dim, generator=gen, dtype=torch.float64).to(device)
    ws = torch.randn(world, TOKENS, cfg.dim, generator=gen, dtype=torch.float64).to(device)

    comms.ledger.reset()
    x = xs[rank : rank + 1].clone().requires_grad_()
    y, _ = layer(x, None)
    (y[0] * ws[rank]).sum().backward()
    xs.requires_grad_()
    y_ref, _ = ref(xs, None)
    (y_ref * ws).sum().backward()
    torch.testing.assert_close(y[0], y_ref[rank].detach())
    torch.testing.assert_close(x.grad[0], xs.grad[rank])

    per, at = cfg.moe_experts // ep, rank % ep
    for (name, p), (_, p_ref) in zip(layer.named_parameters(), ref.named_parameters(), strict=True):
        if name.startswith("experts."):
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            assert p.shape == p_ref.shape and p.to_local().shape[0] == per
            # Summed over the replicas of this shard, each of which saw its ep group's copies.
            got, want = p.grad.to_local().clone(), p_ref.grad[at * per : (at + 1) * per]
            dist.all_reduce(got, group=comms.group("dp_rep").group)
        else:
            got, want = p.grad.clone(), p_ref.grad
            dist.all_reduce(got)
        torch.testing.assert_close(got, want, msg=name)

    ep_recs = [r for r in comms.ledger.records if r.group == "ep"]
    fwd = [r for r in ep_recs if r.phase == "fwd"]
    counts, dispatched, combined = fwd
    # The counts are all-gathered (every rank needs the whole matrix for the receive bound).
    assert counts.tag == "moe.counts" and counts.op == "all_gather"
    assert counts.bytes == ep * cfg.moe_experts * 8
    width = 2 * cfg.rank if dispatch == "latent" else cfg.dim
    out_width = cfg.rank if dispatch == "latent" else cfg.dim
    copies = TOKENS * cfg.moe_top_k
    assert dispatched.bytes == copies * width * 8  # float64
    assert combined.bytes == (combined.elements // out_width) * out_width * 8
    assert [r.phase for r in ep_recs] == ["fwd", "fwd", "fwd", "bwd", "bwd"]
    return {"received": combined.elements // out_width}


@pytest.mark.parametrize(
    ("world", "ep", "dispatch", "shared"),
    [(2, 2, "latent", 1), (2, 2, "hidden", 0), (4, 2, "latent", 0), (4, 4, "hidden", 1)],
)
def test_ep_layer_equals_one_device(world: int, ep: int, dispatch: str, shared: int) -> None:
    got = run_distributed(_ep_checks, world, ep, dispatch, shared, timeout_s=180)
    # Every copy is computed somewhere: the copies the ranks received sum to all of them.
    assert sum(r["received"] for r in got) == world * TOKENS * 2
