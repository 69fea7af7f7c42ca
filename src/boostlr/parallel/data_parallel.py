"""Data parallelism over the mesh's ``dp`` dim with FSDP2 (``fully_shard``), DESIGN §4.1.

``fsdp`` reshards parameters after forward (ZeRO-3-like); ``ddp`` keeps them gathered from
forward to backward and only reduce-scatters gradients (ZeRO-2-like: torch's DDP refuses
multi-dimensional meshes). Parameters arrive as DTensors on the ``tp`` dim, so FSDP takes its
2-D path and gradients, norms and checkpoints see global shapes. FSDP's collectives bypass
:mod:`boostlr.parallel.collectives`; they are recorded in the ledger through FSDP's custom
all-gather / reduce-scatter hooks, with the same payload convention (the full buffer).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from boostlr.parallel.collectives import GroupComm
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.tensor_parallel import TensorParallelModel


def _phase(comm: GroupComm) -> str:
    """``bwd`` inside the autograd engine (FSDP's pre-backward re-gather, gradient reduction)."""
    return "bwd" if torch._C._current_graph_task_id() != -1 else comm.ledger.forward_phase


class _RecordedAllGather(DefaultAllGather):
    def __init__(self, comm: GroupComm):
        self.comm = comm

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = output_tensor.numel()
        self.comm.ledger.record(
            "all_gather",
            self.comm.name,
            _phase(self.comm),
            n * output_tensor.element_size(),
            n,
            "fsdp_params",
        )
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _RecordedReduceScatter(DefaultReduceScatter):
    def __init__(self, comm: GroupComm):
        self.comm = comm

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = input_tensor.numel()
        self.comm.ledger.record(
            "reduce_scatter",
            self.comm.name,
            "bwd",
            n * input_tensor.element_size(),
            n,
            "fsdp_grads",
        )
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def apply_data_parallel(part: TensorParallelModel, comms: MeshComms, mode: str) -> None:
    """``fully_shard`` each block, then the stage (embedding, final norm, head)."""
    reshard = mode == "fsdp"
    modules = [*part.model.layers.values(), part]
    for module in modules:
        fully_shard(module, mesh=comms.dp_mesh, reshard_after_forward=reshard)
    for module in modules:
        assert isinstance(module, FSDPModule)
        module.set_custom_all_gather(_RecordedAllGather(comms.dp))
        module.set_custom_reduce_scatter(_RecordedReduceScatter(comms.dp))
