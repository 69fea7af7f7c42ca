"""Collectives and ledger on real gloo groups (world sizes 2 and 4).

Every rank builds all ranks' inputs from seeds, so it can compute the single-process
reference (the math the sharded computation must equal) next to the distributed run.
All distributed checks of one world size run inside one spawned group (see
``_run_checks``); each is still reported as its own pytest case.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from functools import cache

import pytest
import torch
import torch.distributed as dist
from distributed import DistributedTestError, run_distributed
from torch.utils.checkpoint import checkpoint

from boostlr.parallel.collectives import (
    CommLedger,
    CommRecord,
    GroupComm,
    PendingAllReduce,
    all_reduce_,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    reduce_scatter_to_group,
    scatter_to_group,
)

F64 = torch.float64


def _rand(seed: int, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _leaf_t(t: torch.Tensor) -> torch.Tensor:
    """A leaf holding ``t`` transposed; ``leaf.t()`` is a non-contiguous view equal to ``t``."""
    return t.t().contiguous().requires_grad_()


def _rec(op: str, phase: str, t: torch.Tensor, tag: str) -> CommRecord:
    return CommRecord(op, "tp", phase, t.numel() * t.element_size(), t.numel(), tag)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- checks: each runs on every rank of the world group -------------------------------


def check_comm_properties(rank: int, ws: int, comm: GroupComm) -> None:
    assert (comm.size, comm.rank) == (ws, rank)


def check_copy_then_reduce(rank: int, ws: int, comm: GroupComm) -> None:
    """copy -> rank-specific scaling -> reduce equals sum_r x * w_r, grads included."""
    x_full = _rand(0, 6, 4)
    w = [_rand(100 + r, 6, 4) for r in range(ws)]
    leaf = _leaf_t(x_full)
    s = reduce_from_group(copy_to_group(leaf.t(), comm, "copy") * w[rank], comm, "reduce")
    (s**2).sum().backward()

    ref_x = x_full.clone().requires_grad_()
    ref_s = sum(ref_x * w_r for w_r in w)
    (ref_s**2).sum().backward()

    _close(s, ref_s)
    _close(leaf.grad.t(), ref_x.grad)
    assert comm.ledger.records == [
        _rec("all_reduce", "fwd", x_full, "reduce"),
        _rec("all_reduce", "bwd", x_full, "copy"),
    ]


def check_gather_split(rank: int, ws: int, comm: GroupComm) -> None:
    """Gather along a middle dim; a replicated consumer keeps its own gradient slice."""
    full = _rand(1, 3, 2 * ws, 5)
    mask = _rand(2, 3, 2 * ws, 5)
    leaf = full.narrow(1, 2 * rank, 2).permute(2, 1, 0).contiguous().requires_grad_()
    y = gather_from_group(leaf.permute(2, 1, 0), comm, "gather", dim=-2, grad="split")
    (y**2 * mask).sum().backward()

    ref = full.clone().requires_grad_()
    (ref**2 * mask).sum().backward()

    assert torch.equal(y, full)
    _close(leaf.grad.permute(2, 1, 0), ref.grad.narrow(1, 2 * rank, 2))
    assert comm.ledger.records == [_rec("all_gather", "fwd", full, "gather")]


def check_gather_reduce_scatter(rank: int, ws: int, comm: GroupComm) -> None:
    """Gather along dim 0 feeding rank-specific partial losses: grads are reduce-scattered."""
    full = _rand(3, 2 * ws, 3, 4)
    w = [_rand(200 + r, 2 * ws, 3, 4) for r in range(ws)]
    leaf = _leaf_t(full.narrow(0, 2 * rank, 2).flatten(1))
    x = leaf.t().unflatten(1, (3, 4))
    y = gather_from_group(x, comm, "head_in", dim=0, grad="reduce_scatter")
    (y.tanh() * w[rank]).sum().backward()

    ref = full.clone().requires_grad_()
    sum((ref.tanh() * w_r).sum() for w_r in w).backward()

    assert torch.equal(y, full)
    _close(leaf.grad.t().unflatten(1, (3, 4)), ref.grad.narrow(0, 2 * rank, 2))
    assert comm.ledger.records == [
        _rec("all_gather", "fwd", full, "head_in"),
        _rec("reduce_scatter", "bwd", full, "head_in"),
    ]


def check_scatter(rank: int, ws: int, comm: GroupComm) -> None:
    """Slice a replicated tensor; rank-specific consumers' grads are all-gathered."""
    full = _rand(4, 3, 2 * ws)
    w = [_rand(300 + r, 3, 2) for r in range(ws)]
    leaf = _leaf_t(full)
    y = scatter_to_group(leaf.t(), comm, "scatter", dim=-1)
    (y**3 * w[rank]).sum().backward()

    ref = full.clone().requires_grad_()
    sum((ref[:, 2 * r : 2 * r + 2] ** 3 * w[r]).sum() for r in range(ws)).backward()

    assert torch.equal(y, full[:, 2 * rank : 2 * rank + 2])
    assert y.is_contiguous()
    _close(leaf.grad.t(), ref.grad)
    assert comm.ledger.records == [_rec("all_gather", "bwd", full, "scatter")]


def check_reduce_scatter(rank: int, ws: int, comm: GroupComm) -> None:
    """Reduce-scatter fp32 partials along dim 0 (non-contiguous input); grads gathered."""
    parts = [_rand(10 + r, 2 * ws, 3, dtype=torch.float32) for r in range(ws)]
    w = [_rand(400 + r, 2, 3, dtype=torch.float32) for r in range(ws)]
    leaf = _leaf_t(parts[rank])
    y = reduce_scatter_to_group(leaf.t(), comm, "rs", dim=0)
    (y.sin() * w[rank]).sum().backward()

    refs = [p.clone().requires_grad_() for p in parts]
    total = sum(refs)
    sum((total[2 * r : 2 * r + 2].sin() * w[r]).sum() for r in range(ws)).backward()

    _close(y, total.detach()[2 * rank : 2 * rank + 2])
    _close(leaf.grad.t(), refs[rank].grad)
    assert comm.ledger.records == [
        _rec("reduce_scatter", "fwd", parts[0], "rs"),
        _rec("all_gather", "bwd", parts[0], "rs"),
    ]


def check_all_reduce_inplace(rank: int, ws: int, comm: GroupComm) -> None:
    """SUM and MAX statistics, in place even through a non-contiguous view."""
    vals = [_rand(20 + r, 4, 3, dtype=torch.float32) for r in range(ws)]
    leaf = vals[rank].t().contiguous()
    view = leaf.t()
    out = all_reduce_(view, comm, "sum")
    with comm.ledger.recompute():
        m = all_reduce_(vals[rank].clone(), comm, "max", op=dist.ReduceOp.MAX)

    assert out is view
    _close(leaf.t(), sum(vals))
    assert torch.equal(m, torch.stack(vals).amax(0))
    assert comm.ledger.records == [
        _rec("all_reduce", "fwd", vals[0], "sum"),
        _rec("all_reduce", "recompute", vals[0], "max"),
    ]


def check_checkpoint_recompute(rank: int, ws: int, comm: GroupComm) -> None:
    """Under non-reentrant checkpointing the re-forward's collectives are ``recompute``."""
    x_full = _rand(5, 6, 4)
    w = [_rand(500 + r, 6, 4) for r in range(ws)]
    ledger = comm.ledger

    def region(x: torch.Tensor) -> torch.Tensor:
        h = (copy_to_group(x, comm, "copy") * w[rank]).tanh()
        m = all_reduce_(h.detach().amax(-1, keepdim=True), comm, "max", op=dist.ReduceOp.MAX)
        # The square saves z, so the recompute must run through the reduce.
        return reduce_from_group(h - m, comm, "reduce") ** 2

    leaf = _leaf_t(x_full)
    out = checkpoint(
        region,
        leaf.t(),
        use_reentrant=False,
        context_fn=lambda: (nullcontext(), ledger.recompute()),
    )
    out.sum().backward()

    ref_x = x_full.clone().requires_grad_()
    hs = [(ref_x * w_r).tanh() for w_r in w]
    ref_m = torch.stack([h.detach().amax(-1, keepdim=True) for h in hs]).amax(0)
    (sum(h - ref_m for h in hs) ** 2).sum().backward()

    _close(leaf.grad.t(), ref_x.grad)
    stat = x_full[:, :1]
    assert ledger.records == [
        _rec("all_reduce", "fwd", stat, "max"),
        _rec("all_reduce", "fwd", x_full, "reduce"),
        _rec("all_reduce", "recompute", stat, "max"),
        _rec("all_reduce", "recompute", x_full, "reduce"),
        _rec("all_reduce", "bwd", x_full, "copy"),
    ]
    nbytes = (x_full.numel() + stat.numel()) * 8
    assert ledger.step_metrics() == {
        "comm_tp_bytes": 2 * nbytes + x_full.numel() * 8,
        "comm_tp_calls": 5,
        "comm_tp_bytes_fwd": nbytes,
        "comm_tp_bytes_bwd": x_full.numel() * 8,
        "comm_tp_bytes_recompute": nbytes,
    }


def check_size_one_subgroup(rank: int, ws: int, comm: GroupComm) -> None:
    """A real single-rank group behaves like no group: same tensor back, nothing recorded."""
    groups = [dist.new_group([r]) for r in range(ws)]  # collective: every rank makes all
    solo = GroupComm(groups[rank], "tp", comm.ledger)
    x = _rand(6, 3, 5)
    assert (solo.size, solo.rank) == (1, 0)
    for fn in _ALL_PRIMITIVES:
        assert fn(x, solo) is x
    assert comm.ledger.records == []


def check_non_divisible_split(rank: int, ws: int, comm: GroupComm) -> None:
    x = _rand(7, 3, 2 * ws + 1)
    for fn in (scatter_to_group, reduce_scatter_to_group):
        with pytest.raises(ValueError, match=r"cannot split dim 1 of size \d+ .* 'tp'"):
            fn(x, comm, "bad", dim=-1)
    with pytest.raises(ValueError, match="grad must be"):
        gather_from_group(x, comm, "bad", grad="sum")  # type: ignore[arg-type]
    assert comm.ledger.records == []


def check_pending_all_reduce_matches_the_blocking_one(rank: int, ws: int, comm: GroupComm) -> None:
    """An input-gradient all-reduce started early (``PendingAllReduce.start``) and finished
    later gives bitwise the blocking all-reduce's sum and the same ledger record; one never
    started falls back to the blocking call."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _rand(40 + rank, 4, 6, dtype=torch.float32).mul(1e3).to(dtype)
        early = GroupComm(comm.group, "tp", CommLedger())
        pending = PendingAllReduce(early, "async")
        pending.start(x * 3)
        got = pending.finish(x)
        blocking = GroupComm(comm.group, "tp", CommLedger())
        want = reduce_from_group(x * 3, blocking, "async")
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert [(r.op, r.bytes, r.phase) for r in early.ledger.records] == [
            ("all_reduce", x.numel() * x.element_size(), "bwd")
        ]
        fallback = PendingAllReduce(GroupComm(comm.group, "tp", CommLedger()), "late")
        assert torch.equal(fallback.finish(x * 3), want)


CHECKS: dict[str, Callable[[int, int, GroupComm], None]] = {
    f.__name__.removeprefix("check_"): f
    for f in (
        check_comm_properties,
        check_copy_then_reduce,
        check_gather_split,
        check_gather_reduce_scatter,
        check_scatter,
        check_reduce_scatter,
        check_all_reduce_inplace,
        check_checkpoint_recompute,
        check_size_one_subgroup,
        check_non_divisible_split,
        check_pending_all_reduce_matches_the_blocking_one,
    )
}

_ALL_PRIMITIVES: tuple[Callable[[torch.Tensor, GroupComm], torch.Tensor], ...] = (
    lambda x, c: copy_to_group(x, c, "t"),
    lambda x, c: reduce_from_group(x, c, "t"),
    lambda x, c: gather_from_group(x, c, "t", dim=0),
    lambda x, c: gather_from_group(x, c, "t", dim=1, grad="reduce_scatter"),
    lambda x, c: scatter_to_group(x, c, "t", dim=0),
    lambda x, c: reduce_scatter_to_group(x, c, "t", dim=1),
    lambda x, c: all_reduce_(x, c, "t"),
)


def _run_checks(rank: int, ws: int) -> dict[str, str | None]:
    """Run every check in this rank; map its name to None or the failure traceback.

    Checks assert only after their collectives, so a failing check does not leave the
    ranks out of step for the next one.
    """
    failures: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
        try:
            check(rank, ws, comm)
            failures[name] = None
        except Exception:
            failures[name] = traceback.format_exc()
    return failures


@cache
def _results(world_size: int) -> list[dict[str, str | None]]:
    return run_distributed(_run_checks, world_size, timeout_s=90)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(CHECKS))
def test_distributed(name: str, world_size: int) -> None:
    errors = [f"rank {r}:\n{res[name]}" for r, res in enumerate(_results(world_size)) if res[name]]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)


# --- single-process tests -------------------------------------------------------------


def test_no_group_is_free() -> None:
    ledger = CommLedger()
    comm = GroupComm(None, "tp", ledger)
    x = _rand(8, 4, 3).requires_grad_()
    assert (comm.size, comm.rank) == (1, 0)
    for fn in _ALL_PRIMITIVES[:-1]:
        assert fn(x, comm) is x
    stat = x.detach().clone()
    assert all_reduce_(stat, comm, "t") is stat
    assert ledger.records == []
    assert ledger.step_metrics() == dict.fromkeys(
        [
            "comm_tp_bytes",
            "comm_tp_calls",
            "comm_tp_bytes_fwd",
            "comm_tp_bytes_bwd",
            "comm_tp_bytes_recompute",
        ],
        0,
    )


def test_ledger_totals_and_step_metrics() -> None:
    ledger = CommLedger()
    ledger.record("all_reduce", "tp", "fwd", bytes=64, elements=16, tag="a")
    ledger.record("all_gather", "tp", "bwd", bytes=32, elements=8, tag="b")
    ledger.record("reduce_scatter", "tp", "recompute", bytes=8, elements=2, tag="c")
    ledger.record("all_reduce", "dp", "bwd", bytes=1000, elements=250, tag="grads")

    assert ledger.totals("tp") == {
        "calls": 3,
        "elements": 26,
        "bytes": 104,
        "bytes_fwd": 64,
        "bytes_bwd": 32,
        "bytes_recompute": 8,
    }
    assert ledger.totals()["bytes"] == 1104
    assert ledger.step_metrics() == {
        "comm_tp_bytes": 104,
        "comm_tp_calls": 3,
        "comm_tp_bytes_fwd": 64,
        "comm_tp_bytes_bwd": 32,
        "comm_tp_bytes_recompute": 8,
    }
    assert ledger.step_metrics("comm_dp", group="dp")["comm_dp_bytes_bwd"] == 1000
    ledger.reset()
    assert ledger.records == [] and ledger.totals()["calls"] == 0


def test_ledger_validates_and_recompute_nests() -> None:
    ledger = CommLedger()
    with pytest.raises(ValueError, match="unknown collective"):
        ledger.record("broadcast", "tp", "fwd", 1, 1)
    with pytest.raises(ValueError, match="unknown phase"):
        ledger.record("all_reduce", "tp", "forward", 1, 1)
    with pytest.raises(RuntimeError), ledger.recompute(), ledger.recompute():
        assert ledger.forward_phase == "recompute"
        raise RuntimeError
    assert ledger.forward_phase == "fwd"


def _fail_on_rank_1(rank: int, ws: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # would block forever without the failing peer
    time.sleep(60)


def test_run_distributed_reports_rank_failure() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1.*ValueError: boom from rank 1"):
        run_distributed(_fail_on_rank_1, 2, timeout_s=60)
    assert time.monotonic() - start < 30
