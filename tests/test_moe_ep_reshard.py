"""Expert shards are DTensors with the global expert dimension, so DCP reshards them: a state
saved at dp 2 x ep 2 reads back whole in one process (ep 1), and a one-device state loads
into the ep 2 shards (each rank its rows). The trainer's resume across ep, which relies on
this layout, is checked in tests/test_moe_ep_train.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from parallel_cases import layout_config
from torch.distributed.tensor import DTensor

from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel
from boostlr.rundir import dcp_io
from boostlr.specs.moe import is_routed_expert

cpu = torch.device("cpu")
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32}


def _cfg(dp: int, ep: int):
    cfg = layout_config("cola", "auto", 1, dp, 1, **MOE)
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
