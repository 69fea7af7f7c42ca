"""Expert parallelism, its foundations: the ``parallel.ep`` key, the expert mesh carved out of
dp, and the autograd-aware variable all-to-all (counts first, payload second) on real gloo.

The expert-parallel MoE layer itself is checked in tests/test_moe_ep_layer.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed import rank_device, run_distributed

from boostlr.config import ModelConfig, ParallelConfig
from boostlr.config.validate_moe import validate_moe
from boostlr.errors import ConfigError
from boostlr.parallel.collectives import all_to_all_single, gather_counts
from boostlr.parallel.mesh import build_mesh, expert_mesh_shape, single_process_comms

MOE = ModelConfig(arch="cola", n_layers=2, rank=8, moe_experts=4, moe_top_k=2, moe_ffn_dim=16)


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        (MOE, ParallelConfig(dp=2, ep=0), "parallel.ep must be >= 1"),
        (ModelConfig(), ParallelConfig(dp=2, ep=2), "needs routed experts"),
        (MOE, ParallelConfig(dp=3, ep=2), "parallel.ep 2 must divide parallel.dp 3"),
        (MOE, ParallelConfig(dp=6, ep=3), "must divide model.moe_experts 4"),
        (MOE, ParallelConfig(dp=2, ep=2, ep_receive_factor=0.5), "must be 0 \\(no bound\\)"),
        (MOE, ParallelConfig(dp=2, ep=2, ep_receive_factor=-1), "must be 0 \\(no bound\\)"),
    ],
)
def test_ep_is_refused_in_one_line(model: ModelConfig, parallel: ParallelConfig, message: str):
    with pytest.raises(ConfigError, match=message) as err:
        validate_moe(model, parallel)
    assert "\n" not in str(err.value)


def test_dropless_ep_under_compile_is_refused_and_a_capacity_is_not() -> None:
    with pytest.raises(ConfigError, match="train.compile with parallel.ep 2 needs a capacity"):
        validate_moe(MOE, ParallelConfig(dp=2, ep=2), compile=True)
    validate_moe(dataclasses.replace(MOE, moe_capacity=1.0), ParallelConfig(dp=2, ep=2), True)
    validate_moe(MOE, ParallelConfig(dp=2, ep=1), compile=True)  # ep 1: no all-to-all


def test_ep_that_divides_is_accepted_and_the_expert_mesh_splits_dp() -> None:
    validate_moe(MOE, ParallelConfig(dp=2, ep=1))
    validate_moe(ModelConfig(), ParallelConfig(dp=2))
    validate_moe(MOE, ParallelConfig(dp=4, ep=2))  # the trainer runs it
    p = ParallelConfig(pp=2, dp=4, ep=2, tp=2)
    assert expert_mesh_shape(p) == {"pp": 2, "dp_rep": 2, "ep": 2, "tp": 2}
    comms = single_process_comms()
    assert comms.ep.size == 1 and comms.ep.name == "ep" and comms.dim_mesh("ep") is None
    x = torch.randn(3, 2, requires_grad=True)
    assert all_to_all_single(x, [3], [3], comms.ep, "t") is x
    assert not comms.ledger.records


def _all_to_all_checks(rank: int, world: int, ep: int) -> list[str]:
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(dp=world, ep=ep, device=device.type), device)
    comm = comms.ep
    # ep consecutive dp ranks form an ep group; dp_rep joins the ranks at one ep index.
    base = rank - rank % ep
    assert dist.get_process_group_ranks(comm.group) == list(range(base, base + ep))
    assert comm.size == ep and comm.rank == rank % ep
    assert comms.group("dp_rep").size == world // ep
    assert comms.dim_mesh("ep").size() == ep and comms.dp.size == world

    width = 3
    gen = torch.Generator().manual_seed(0)  # every rank draws every rank's data alike
    members = range(base, base + ep)
    splits = {r: torch.randint(0, 4, (ep,), generator=gen).tolist() for r in range(world)}
    xs = {r: torch.randn(sum(splits[r]), width, generator=gen) for r in range(world)}
    ws = {
        r: torch.randn(sum(splits[j][r % ep] for j in members), width, generator=gen)
        for r in range(world)
    }
    # Per-expert counts, two experts per destination: [ep, 2] with rows summing to splits.
    counts = torch.tensor([[s - s // 2, s // 2] for s in splits[rank]], dtype=torch.int64)
    # The whole matrix on every rank (the receive bound's input): row j is member j's counts.
    matrix = gather_counts(counts.to(device), comm, "t")  # [source, destination, expert]
    for j, src in enumerate(members):
        assert matrix[j].tolist() == [[s - s // 2, s // 2] for s in splits[src]]
    got_counts = matrix[:, rank % ep]  # what each member sends this rank
    for j, src in enumerate(members):
        s = splits[src][rank % ep]
        assert got_counts[j].tolist() == [s - s // 2, s // 2]
    gathered = comms.ledger.records[-1]
    assert (gathered.op, gathered.tag, gathered.bytes) == ("all_gather", "t.counts", ep * ep * 16)
    recv = got_counts.sum(1).tolist()
    comms.ledger.reset()

    x = xs[rank].clone().to(device).requires_grad_()
    out = all_to_all_single(x, splits[rank], recv, comm, "t")
    (out * ws[rank].to(device)).sum().backward()

    # The gathered reference: every member's rows, cut by its splits, in source order.
    ref_x = {r: xs[r].clone().requires_grad_() for r in members}
    cut = {r: ref_x[r].split(splits[r]) for r in members}
    loss = sum((torch.cat([cut[s][d % ep] for s in members]) * ws[d]).sum() for d in members)
    loss.backward()
    torch.testing.assert_close(
        out.detach().cpu(), torch.cat([cut[s][rank % ep] for s in members]).detach()
    )
    torch.testing.assert_close(x.grad.cpu(), ref_x[rank].grad)

    recs = comms.ledger.records
    assert [(r.op, r.group, r.phase) for r in recs] == [
        ("all_to_all", "ep", "fwd"),
        ("all_to_all", "ep", "bwd"),
    ]
    assert recs[0].bytes == x.numel() * 4 and recs[1].bytes == out.numel() * 4
    return [r.tag for r in recs]


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (4, 4)])
def test_all_to_all_matches_a_gathered_reference(world: int, ep: int) -> None:
    tags = run_distributed(_all_to_all_checks, world, ep, timeout_s=120)
    assert tags == [["t", "t"]] * world
