"""Expert parallelism's memory bound and its capacity (docs/moe.md, "A bound on what a rank
receives"), against the one-device layer on real gloo ranks.

- **Bounded dropless.** A forced hot expert (every token picks the two experts of ep rank 0)
  at dp 2 x ep 2 with ``ep_receive_factor 1``: no rank receives more than ``T · k`` rows,
  the copies past each cell's quota are dropped (max-min fair over ``(source, expert)``
  cells; first choices, then earlier tokens, kept), every rank computed the same quotas,
  and the output and every gradient equal the one-device dropless layer's with the dropped
  copies' weights zeroed. Without overflow the bounded layer is the unbounded one, bit for
  bit.
- **Capacity at ep > 1.** Fixed ``[ep, E/ep, capacity, width]`` all-to-alls, no count
  exchange and no host read; the output, the drops and every gradient equal the
  one-device capacity layer run on each rank's tokens (dp at ep 1).

float64, so any difference beyond summation order is a bug.
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import rank_device, run_distributed

from boostlr.config import ModelConfig, ParallelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models.moe import MoEMLP, make_moe_mlp
from boostlr.models.moe_dispatch import expert_counts, with_capacity
from boostlr.models.moe_routing import Routing, top_k_routing
from boostlr.parallel import expert_parallel as ep_module
from boostlr.parallel.ep_bound import bounded_order, capacity_slots, receive_quota
from boostlr.parallel.expert_parallel import shard_experts
from boostlr.parallel.mesh import build_mesh

TOKENS, K, EXPERTS = 6, 2, 4  # per rank: one sequence; top 2 of 4
CONVERSIONS = ("item", "__float__", "__bool__", "tolist", "__int__")


# ------------------------------------------------------------------ one process: the rules


def test_quota_is_max_min_fair_and_under_the_cap() -> None:
    # [source 2, destination 2, local expert 2]; destination 0 gets 6 + 1 + 5 + 2 = 14.
    matrix = torch.tensor([[[6, 1], [0, 2]], [[5, 2], [3, 3]]])
    quota = receive_quota(matrix, torch.tensor(10))
    # Destination 0: cells 1 and 2 kept whole, 6 and 5 cut to the level (10 - 3) // 2 = 3.
    assert quota[:, 0].tolist() == [[3, 1], [3, 2]]
    assert torch.equal(quota[:, 1], matrix[:, 1])  # 8 rows fit
    assert torch.equal(receive_quota(matrix, torch.tensor(14)), matrix)
    assert receive_quota(matrix, None) is matrix
    gen = torch.Generator().manual_seed(0)
    for cap in range(0, 40, 3):
        m = torch.randint(0, 12, (4, 4, 3), generator=gen)
        q = receive_quota(m, torch.tensor(cap))
        got = q.sum((0, 2))
        assert (q <= m).all() and (q >= 0).all()
        assert (got <= torch.clamp(m.sum((0, 2)), max=cap)).all()
        # Within the bound no more than one row short per cut cell (the floor of the level).
        assert (got >= torch.clamp(m.sum((0, 2)), max=cap) - m.shape[0] * m.shape[2]).all()


def test_bounded_order_keeps_first_choices_then_earlier_tokens() -> None:
    idx = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])  # 4 tokens, top 2 of 3
    expert = top_k_routing(idx, torch.ones(4, 2), torch.zeros(4, 3)).expert
    counts = expert_counts(expert, 3)  # [4, 3, 1]
    order = bounded_order(expert, counts, torch.tensor([2, 3, 1]))
    # The map lists copy j · T + t (token t's choice j). Expert 0's copies by priority:
    # first choices of tokens 0, 2, 3, then token 1's second: the first two (tokens 0 and
    # 2) are kept; the other two go after every kept copy.
    kept = order[: 2 + 3 + 1]
    # Expert 1's three (t1 first, t0 second, t3 second) and expert 2's one all fit.
    assert kept.tolist() == [0, 2, 1, 4, 7, 6]
    assert sorted(order[6:].tolist()) == [3, 5]  # token 3's first, token 1's second
    # Nothing to drop: the dropless order.
    loose = bounded_order(expert, counts, counts)
    assert torch.equal(loose, torch.argsort(expert, stable=True))


def test_capacity_slots_drop_what_the_single_device_path_drops() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(16, 5, generator=gen)
    idx = torch.topk(scores + torch.tensor([1.0, 0.5, 0, 0, 0]), 2).indices  # skewed
    payload = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    weights = torch.rand(16, 2, generator=gen, dtype=torch.float64)
    route = top_k_routing(idx, weights, scores)
    _, dropped = with_capacity(payload, route, 5, 4, lambda x, e: x)
    _, kept = capacity_slots(route.expert, expert_counts(route.expert, 5), 4)
    assert int(dropped) == int((~kept).sum()) > 0
    # The same copies: token t's choice j survives iff its weight reaches the output.
    for j in range(2):
        w = torch.zeros(16, 2, dtype=torch.float64)
        w[:, j] = 1.0
        out, _ = with_capacity(payload, top_k_routing(idx, w, scores), 5, 4, lambda x, e: x)
        survived = (out != 0).any(-1)
        assert torch.equal(survived, kept.view(2, 16)[j])


# ------------------------------------------------------------------ real ranks


def _layer(capacity: float = 0.0) -> tuple[ModelConfig, MoEMLP]:
    cfg = resolve_model(
        ModelConfig(
            preset="tiny", arch="cola", dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32,
            n_layers=2, rank=4, moe_experts=EXPERTS, moe_top_k=K, moe_ffn_dim=8,
            vocab_size=32, moe_shared=1, moe_capacity=capacity,
        )
    )  # fmt: skip
    validate_moe(cfg)
    layer = make_moe_mlp(cfg, 1)
    assert layer is not None
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return cfg, layer.double()


def _hot(layer: MoEMLP) -> None:
    """Every token picks experts 0 and 1 (ep rank 0's): the bias decides the selection."""
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))


class _Received:
    """What this rank receives in each payload all-to-all, and the quotas it computed (the
    real functions run; only their results are noted)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.quotas: list[list] = []
        self._a2a, self._quota = ep_module.all_to_all_single, ep_module.receive_quota

    def __enter__(self) -> _Received:
        def a2a(x, send, recv, comm, tag):
            self.rows.append(sum(recv))
            return self._a2a(x, send, recv, comm, tag)

        def quota(matrix, cap):
            q = self._quota(matrix, cap)
            self.quotas.append(q.tolist())
            return q

        ep_module.all_to_all_single, ep_module.receive_quota = a2a, quota
        return self

    def __exit__(self, *exc) -> None:
        ep_module.all_to_all_single, ep_module.receive_quota = self._a2a, self._quota


def _run(layer: MoEMLP, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y, _ = layer(x, None)
    (y * w).sum().backward()
    grads = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in layer.parameters()
    ]
    return (y.detach(), x.grad, *[g.clone() for g in grads])


def _reduced(layer: MoEMLP, grads: tuple[torch.Tensor, ...], comms) -> list[torch.Tensor]:
    """Gradients summed as the step sums them: dp for the rest, dp_rep for expert shards."""
    out = []
    for (name, _), g in zip(layer.named_parameters(), grads, strict=True):
        g = g.clone()
        group = comms.group("dp_rep").group if name.startswith("experts.") else None
        dist.all_reduce(g, group=group)
        out.append(g)
    return out


def _compare(layer, ref, got, want, comms, rank: int, ep: int) -> None:
    y, xg, *grads = got
    y_ref, xg_ref, *ref_grads = want
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xg, xg_ref)
    per, at = EXPERTS // ep, rank % ep
    summed = _reduced(layer, tuple(grads), comms)
    for (name, _), g, g_ref in zip(layer.named_parameters(), summed, ref_grads, strict=True):
        if name.startswith("experts."):
            g_ref = g_ref[at * per : (at + 1) * per]
        torch.testing.assert_close(g, g_ref, msg=name)


def _keep_mask(idx: torch.Tensor, quota_row: list[list[int]], world: int) -> torch.Tensor:
    """The copies of ``idx [world · T, k]`` a bound keeps, by the documented rule, written
    out here: per (source rank, expert) cell, first choices then earlier tokens first."""
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for src in range(world):
        block = idx[src * TOKENS : (src + 1) * TOKENS]
        for e in range(EXPERTS):
            q = quota_row[src][e]
            copies = [(j, t) for j in range(K) for t in range(TOKENS) if block[t, j] == e]
            for j, t in copies[:q]:
                keep[src * TOKENS + t, j] = True
    return keep


def _bound_checks(rank: int, world: int, ep: int) -> dict:
    assert world == ep  # one ep group: the sources are all the ranks
    device = rank_device(rank)
    comms = build_mesh(ParallelConfig(dp=world, ep=ep, device=device.type), device)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(world, TOKENS, 16, generator=gen, dtype=torch.float64).to(device)
    ws = torch.randn(world, TOKENS, 16, generator=gen, dtype=torch.float64).to(device)
    result: dict = {}

    # 1. No overflow: the bound (factor 2 at ep 2 cannot bind) is the unbounded layer.
    _, ref = _layer()
    free, bounded = copy.deepcopy(ref), copy.deepcopy(ref)
    shard_experts(free, comms, 0.0)
    shard_experts(bounded, comms, 2.0)
    a = _run(free, xs[rank : rank + 1], ws[rank : rank + 1])
    b = _run(bounded, xs[rank : rank + 1], ws[rank : rank + 1])
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert int(bounded.dropped) == 0

    # 2. A hot expert, bound 1: rank 0 would receive every copy; it receives T · k.
    _hot(ref)
    layer = copy.deepcopy(ref)
    shard_experts(layer, comms, 1.0)
    with _Received() as seen:
        got = _run(layer, xs[rank : rank + 1], ws[rank : rank + 1])
    cap = TOKENS * K  # ceil(1 · T · k)
    assert max(seen.rows) <= cap, seen.rows
    result["received"] = seen.rows
    result["quotas"] = seen.quotas
    result["dropped"] = int(layer.dropped)
    # The one-device layer on all tokens, the dropped copies' weights zeroed.
    quota = torch.tensor(seen.quotas[0])  # [source, destination, local expert]
    flat_quota = quota.reshape(ep, EXPERTS).tolist()  # [source, global expert]
    select = ref.router.forward

    def masked(x: torch.Tensor) -> Routing:
        route = select(x)
        idx = route.expert.view(K, -1).t()  # the top-k map's copies as [tokens, k]
        keep = _keep_mask(idx, flat_quota, world)
        return route._replace(weight=route.weight * keep.t().reshape(-1))

    ref.router.forward = masked
    want = _run(ref, xs.view(1, world * TOKENS, 16), ws.view(1, world * TOKENS, 16))
    want = (want[0].view(world, TOKENS, -1)[rank : rank + 1],
            want[1].view(world, TOKENS, -1)[rank : rank + 1], *want[2:])  # fmt: skip
    _compare(layer, ref, got, want, comms, rank, ep)
    result["capacity"] = _capacity_checks(rank, world, ep, 1.0, comms)
    return result


@pytest.mark.parametrize(("world", "ep"), [(2, 2)])
def test_hot_expert_is_bounded_alike_on_every_rank(world: int, ep: int) -> None:
    """Also runs the capacity checks at dp 2 x ep 2 on the same ranks."""
    got = run_distributed(_bound_checks, world, ep, timeout_s=240)
    # The same quotas on every rank (decided from the same gathered counts).
    assert all(r["quotas"] == got[0]["quotas"] for r in got)
    # All 2 · T · k copies went to rank 0, which kept T · k of them: the rest were dropped.
    assert sum(r["dropped"] for r in got) == world * TOKENS * K - TOKENS * K
    assert all(r["dropped"] == TOKENS * K // 2 for r in got)  # max-min fair: half each
    assert sum(r["capacity"]["dropped"] for r in got) > 0  # capacity's drops exercised too


def _capacity_checks(rank: int, world: int, ep: int, factor: float, comms=None) -> dict:
    device = rank_device(rank)
    if comms is None:
        comms = build_mesh(ParallelConfig(dp=world, ep=ep, device=device.type), device)
    gen = torch.Generator().manual_seed(2)
    xs = torch.randn(world, TOKENS, 16, generator=gen, dtype=torch.float64).to(device)
    ws = torch.randn(world, TOKENS, 16, generator=gen, dtype=torch.float64).to(device)
    _, ref = _layer(capacity=factor)
    with torch.no_grad():  # skewed, so capacity drops
        ref.router.expert_bias.copy_(torch.tensor([0.6, 0.3, 0.0, 0.0]))
    layer = copy.deepcopy(ref)
    shard_experts(layer, comms)
    comms.ledger.reset()
    conversions: Counter = Counter()
    originals = {n: getattr(torch.Tensor, n) for n in CONVERSIONS}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            conversions[name] += 1
            return originals[name](self, *args, **kwargs)

        return wrapper

    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    try:
        got = _run(layer, xs[rank : rank + 1], ws[rank : rank + 1])
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    assert not conversions, conversions  # no host read: fixed shapes end to end
    # The one-device capacity layer on this rank's tokens: the same slots, the same drops.
    mine = copy.deepcopy(ref)
    want = _run(mine, xs[rank : rank + 1], ws[rank : rank + 1])
    assert int(layer.dropped) == int(mine.dropped)
    # Every rank's one-device gradients, summed: what dp at ep 1 reduces.
    _compare(layer, ref, got, (want[0], want[1], *_reduced_plain(want[2:])), comms, rank, ep)
    recs = [r for r in comms.ledger.records if r.group == "ep"]
    assert not [r for r in recs if r.tag.endswith("counts")]
    capacity = math.ceil(factor * TOKENS * K / EXPERTS)
    assert [r.elements for r in recs if r.phase == "fwd"] == [
        EXPERTS * capacity * 8,  # the 2r = 8 wide latents
        EXPERTS * capacity * 4,  # the r = 4 wide results
    ]
    return {"dropped": int(layer.dropped)}


def _reduced_plain(grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out = []
    for g in grads:
        g = g.clone()
        dist.all_reduce(g)
        out.append(g)
    return out


@pytest.mark.parametrize(("world", "ep"), [(4, 2)])  # (2, 2): in the hot-expert test's ranks
def test_capacity_at_ep_equals_the_one_device_capacity_path(world: int, ep: int) -> None:
    got = run_distributed(_capacity_checks, world, ep, 1.0, timeout_s=240)
    assert sum(r["dropped"] for r in got) > 0  # the drops were exercised


# ------------------------------------------------------------------ the trainer


def _train_hot(rank: int, world: int, data: str, run_dir: str, overrides: dict) -> dict:
    """Train this rank's part with every token routed to experts 0 and 1 (ep rank 0's),
    noting each payload all-to-all's received rows and each bound's quotas."""
    from test_train import tiny_run_config

    from boostlr.config import resolve
    from boostlr.models.moe_router import TopKRouter
    from boostlr.train import run as trainer

    cfg = tiny_run_config(Path(data), **overrides)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    select = TopKRouter.select

    def hot(self, logits):
        offset = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        offset[:2] = 30.0  # experts 0 and 1 win every selection
        return select(self, logits + offset)

    TopKRouter.select = hot
    try:
        with _Received() as seen:
            trainer._train_rank(cfg, Path(run_dir), None, False, torch.device("cpu"), datasets)
    finally:
        TopKRouter.select = select
    tokens = cfg.train.batch_size * cfg.data.seq_len
    tp_rank = rank % cfg.parallel.tp  # the mesh's last dim is tp
    return {"received": seen.rows, "quotas": seen.quotas, "tokens": tokens, "tp_rank": tp_rank}


@pytest.mark.parametrize("tp", [1, 2])
def test_hot_expert_trains_within_the_bound(small_dataset: Path, tmp_path: Path, tp: int) -> None:
    """dp 2 x ep 2 (and x tp 2 under BTP, where each TP rank dispatches its ``T / tp``
    share), every token to ep rank 0's experts, ``ep_receive_factor 1``: the steps go on
    with finite losses, no all-to-all delivers more than ``T / tp · k`` rows to a rank,
    every rank computed the same quotas, and the rows count the drops of every share."""
    from test_train import read_rows, tiny_run_config

    from boostlr.config import resolve
    from boostlr.train import run as trainer

    overrides = {
        "model.moe_experts": EXPERTS, "model.moe_top_k": K, "model.moe_ffn_dim": 64,
        "parallel.dp": 2, "parallel.ep": 2, "parallel.ep_receive_factor": 1.0, "parallel.tp": tp,
        "train.steps": 3, "train.eval_every": 100, "train.ckpt_every": 100,
    }  # fmt: skip
    run_dir = tmp_path / "run"
    cfg = tiny_run_config(small_dataset, **overrides)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    got = run_distributed(_train_hot, 2 * tp, str(small_dataset), str(run_dir), overrides)
    cap = got[0]["tokens"] // tp * K  # ceil(1 · T / tp · k)
    for r in got:
        assert r["received"] and max(r["received"]) <= cap, (cap, max(r["received"]))
        same_tp = got[r["tp_rank"]]  # global rank tp_rank: dp 0, the same TP rank
        assert r["quotas"] == same_tp["quotas"]  # the same decision on every ep rank
    assert max(got[0]["received"]) == cap  # rank 0 was filled to the bound, not past it
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    layers = cfg.model.n_layers - cfg.model.moe_dense_layers
    # Each layer and micro-batch: 2 · T · k copies for rank 0, T · k kept (summed over the
    # TP ranks' shares).
    dropped = layers * cfg.train.grad_accum * got[0]["tokens"] * K
    assert [r["moe_dropped"] for r in rows] == [dropped] * 3, rows


# ------------------------------------------------------------------ boostlr plan


PLAN_1B = [
    "plan", "--hardware", "h200", "--model.preset", "1B", "--model.moe_experts", "16",
    "--model.moe_top_k", "2", "--model.moe_ffn_dim", "1024", "--data.seq_len", "2048",
    "--train.batch_size", "2", "--gpus", "16", "--parallel.dp", "-1", "--parallel.ep", "4",
    "--json",
]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "rows_of"),
    [
        ([], lambda t: 2 * t * 2),  # the default factor 2: ceil(2 · T · k)
        (["--parallel.ep_receive_factor", "1.5"], lambda t: math.ceil(1.5 * t * 2)),
        (["--parallel.ep_receive_factor", "0"], lambda t: 4 * t * 2),  # ep · T · min(k, E/ep)
        (["--model.moe_capacity", "1.25"], lambda t: 16 * math.ceil(1.25 * t * 2 / 16)),
    ],
)
def test_plan_shows_the_worst_rank_under_the_bound(
    extra: list[str], rows_of, capsys: pytest.CaptureFixture[str]
) -> None:
    from boostlr.cli import main

    assert main([*PLAN_1B, *extra]) == 0
    data = json.loads(capsys.readouterr().out)
    for row in data["rows"]:
        bound, tokens = row["moe"]["receive"], 2 * 2048
        assert bound["rows"] == rows_of(tokens) and bound["balanced_rows"] == tokens * 2
        assert bound["extra_bytes"] > 0  # every bound here is above the balanced load
        assert bound["memory_gb_at_bound"] == pytest.approx(
            row["memory_gb"] + bound["extra_bytes"] / 1e9
        )
        limit = data["hardware"]["memory"] / 1e9
        assert bound["fits_at_bound"] == (bound["memory_gb_at_bound"] <= limit)
    assert main([*PLAN_1B[:-1], *extra]) == 0  # the table prints one line per row
    lines = [x for x in capsys.readouterr().out.splitlines() if "a rank receives at most" in x]
    assert len(lines) == 3 and all(x.endswith(("fits", "does NOT fit")) for x in lines), lines
