"""Expert shards are DTensors with the global expert dimension, so DCP reshards them: a state
saved at dp 2 x ep 2 reads back whole in one process (ep 1), and a one-device state loads
into the ep 2 shards (each rank its rows). At dp 4 x ep 2 the experts are FSDP-sharded over
``dp_rep`` as well (``(dp_rep, ep)`` DTensors): the weights and AdamW moments saved there
load exactly at dp 4 x ep 4, at dp 2 x ep 1 and in one process. The trainer's resume across
ep, which relies on this layout, is checked in tests/test_moe_ep_train.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from parallel_cases import global_batch, layout_config
from torch.distributed.tensor import DTensor

from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel
from boostlr.rundir import dcp_io
from boostlr.rundir.payload import sharded
from boostlr.specs.moe import is_routed_expert
from boostlr.train.optim import build_optimizer, init_optimizer_state

cpu = torch.device("cpu")
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32}


def _cfg(dp: int, ep: int, **extra: object):
    cfg = layout_config("cola", "auto", 1, dp, 1, **{**MOE, **extra})
    # layout_config takes no parallel.ep: set it on the built config.
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))


def _reshard(rank: int, world: int, root: str) -> None:
    cfg = _cfg(world, world)
    model = ParallelModel.build(cfg, cpu)
    ep2 = Path(root) / "ep2"
    dcp.save({n: p.detach() for n, p in model.named_parameters()}, checkpoint_id=ep2)
    one = Path(root) / "ep1"
    if rank == 0:  # a one-device state, every value moved off the init
        whole = build_model(cfg.model, seed=cfg.train.seed)
        dcp.save({n: p.detach() + 1 for n, p in whole.named_parameters()}, checkpoint_id=one,
                 no_dist=True)  # fmt: skip
    dist.barrier()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    dcp.load(state, checkpoint_id=one)
    init = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
    per = cfg.model.moe_experts // world
    for name, value in state.items():
        want = init[name].detach() + 1
        if is_routed_expert(name):
            assert isinstance(value, DTensor)
            want = want[rank * per : (rank + 1) * per]
            value = value.to_local()
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        assert torch.equal(value, want), name


def test_experts_saved_at_ep2_load_at_ep1_and_back(tmp_path: Path) -> None:
    run_distributed(_reshard, 2, str(tmp_path), timeout_s=240)
    cfg = _cfg(1, 1)
    whole = build_model(cfg.model, seed=cfg.train.seed)
    state = {n: torch.zeros_like(p) for n, p in whole.named_parameters()}
    dcp_io.load(state, tmp_path / "ep2", None)  # one process, as boostlr's readers do
    assert any(is_routed_expert(n) for n in state)
    for name, p in whole.named_parameters():
        assert torch.equal(state[name], p.detach()), name


def _reshard_tp(rank: int, world: int, root: str) -> None:
    """dp 2 x ep 2 x tp 2 under BTP: each ep rank's experts held alike by its two TP ranks
    (``Shard(0)`` on ``ep``), the factors split over tp. Its state saves (one process reads
    it back below), and a one-device state loads into its shards, each rank its rows."""
    cfg = layout_config("cola", "btp", 1, 2, 2, **{**MOE, "parallel.ep": 2})
    model = ParallelModel.build(cfg, cpu)
    dcp.save({n: p.detach() for n, p in model.named_parameters()}, checkpoint_id=Path(root))
    state = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    dcp.load(state, checkpoint_id=Path(root) / "plus1")
    init = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
    ep = model.comms.ep
    per = cfg.model.moe_experts // ep.size
    for name, value in state.items():
        want = init[name].detach() + 1
        if is_routed_expert(name):
            assert value.device_mesh.mesh_dim_names == ("ep",), name
            want, value = want[ep.rank * per : (ep.rank + 1) * per], value.to_local()
        else:
            value = value.full_tensor()
        assert torch.equal(value, want), name


def test_experts_saved_at_ep2_tp2_reshard_to_one_device_and_back(tmp_path: Path) -> None:
    cfg = layout_config("cola", "btp", 1, 2, 2, **{**MOE, "parallel.ep": 2})
    whole = build_model(cfg.model, seed=cfg.train.seed)
    plus1 = {n: p.detach() + 1 for n, p in whole.named_parameters()}
    dcp.save(plus1, checkpoint_id=tmp_path / "plus1", no_dist=True)
    run_distributed(_reshard_tp, 4, str(tmp_path), timeout_s=240)
    state = {n: torch.zeros_like(p) for n, p in whole.named_parameters()}
    dcp_io.load(state, tmp_path, None)  # one process, as boostlr's readers do
    assert any(is_routed_expert(n) for n in state)
    for name, p in whole.named_parameters():
        assert torch.equal(state[name], p.detach()), name


SAVED_AT = (4, 2)  # dp, ep
WIDE = {"model.moe_experts": 8}  # dp_rep 2 x ep 2 of 8 experts: two rows per rank


def _trained_state(dp: int, ep: int) -> tuple[ParallelModel, dict]:
    """A model at ``dp x ep`` and AdamW state, one step in (every moment nonzero), as the
    checkpoint holds them (:func:`boostlr.rundir.payload.sharded`)."""
    cfg = _cfg(dp, ep, **WIDE)
    model = ParallelModel.build(cfg, cpu)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    init_optimizer_state(optimizer)
    inputs, targets = global_batch(cfg)
    b, rank = cfg.train.batch_size, dist.get_rank()
    model.forward_backward(inputs[rank * b : (rank + 1) * b], targets[rank * b : (rank + 1) * b])
    model.reduce_expert_gradients()
    optimizer.step()
    return model, sharded(list(model.named_parameters()), optimizer)


def _empty_like(state: dict) -> dict:
    """Zeros of ``state``'s layout (a DTensor keeps its mesh and placements)."""
    return {
        key: _empty_like(value) if isinstance(value, dict) else torch.zeros_like(value)
        for key, value in state.items()
    }


def _whole(state: dict) -> dict:
    """Every tensor of ``state`` at its global shape, by flattened key."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out |= {f"{key}.{k}": v for k, v in _whole(value).items()}
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
        else:
            out[key] = value.detach().clone()
    return out


def _save_at_dp4_ep2(rank: int, world: int, root: str) -> dict:
    """Save at dp 4 x ep 2; load into dp 4 x ep 4, in the same ranks; both whole, on rank 0."""
    model, state = _trained_state(*SAVED_AT)
    for name, p in model.named_parameters():
        if is_routed_expert(name):  # the layout under test: FSDP over dp_rep within ep
            assert p.device_mesh.mesh_dim_names == ("dp_rep", "ep"), name
    dcp.save(state, checkpoint_id=Path(root) / "dp4_ep2")
    saved = _whole(state)
    other, target = _trained_state(4, 4)
    target = _empty_like(target)
    dcp.load(target, checkpoint_id=Path(root) / "dp4_ep2")
    loaded = _whole(target)
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    return saved if rank == 0 else {}


def _load_at_dp2_ep1(rank: int, world: int, root: str) -> dict:
    _, state = _trained_state(2, 1)
    target = _empty_like(state)
    dcp.load(target, checkpoint_id=Path(root) / "dp4_ep2")
    whole = _whole(target)  # a collective: every rank
    return whole if rank == 0 else {}


def test_experts_sharded_over_dp_rep_reshard_exactly(tmp_path: Path) -> None:
    saved = run_distributed(_save_at_dp4_ep2, 4, str(tmp_path), timeout_s=300)[0]
    experts = [k for k in saved if is_routed_expert(k)]
    assert experts and any(k.startswith("optim.") for k in experts)
    at_dp2 = run_distributed(_load_at_dp2_ep1, 2, str(tmp_path), timeout_s=300)[0]
    assert set(at_dp2) == set(saved)
    for key, value in saved.items():
        assert torch.equal(at_dp2[key], value), key
    whole = {k: torch.zeros_like(v) for k, v in saved.items() if k.startswith("model.")}
    dcp_io.load(whole, tmp_path / "dp4_ep2", None)  # one process, as boostlr's readers do
    for key, value in whole.items():
        assert torch.equal(value, saved[key]), key
