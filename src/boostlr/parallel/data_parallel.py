"""Data parallelism over the mesh's ``dp`` dim with FSDP2 (``fully_shard``), docs/design.md §4.

``fsdp`` reshards parameters after forward (ZeRO-3-like); ``ddp`` keeps them gathered from
forward to backward and only reduce-scatters gradients (ZeRO-2-like: torch's DDP refuses
multi-dimensional meshes). Parameters arrive as DTensors on the ``tp`` dim, so FSDP takes its
2-D path and gradients, norms and checkpoints see global shapes. FSDP's collectives bypass
:mod:`boostlr.parallel.collectives`; they are recorded in the ledger through FSDP's custom
all-gather / reduce-scatter hooks, with the same payload convention (the full buffer), and
timed there: on CPU (gloo) the calls block the host, so their wall time is the time blocked;
on CUDA they run on FSDP's own streams, so the events measure their duration there (an upper
bound of what the compute stream waits for). An asynchronous call (FSDP's explicit
``unshard(async_op=True)``) is timed where its work is waited on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
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


class _TimedWork(dist.Work):
    """An asynchronous collective whose ``wait`` is timed into the ledger."""

    def __init__(self, work: dist.Work, comm: GroupComm, device: torch.device, label: str):
        super().__init__()
        self.work, self.comm, self.device, self.label = work, comm, device, label

    def wait(self, timeout=None) -> bool:  # type: ignore[override]
        with _timed(self.comm, self.device, self.label):
            return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextmanager
def _timed(comm: GroupComm, device: torch.device, label: str):
    with torch.profiler.record_function(label), comm.ledger.timed(comm.name, device):
        yield


def _call_timed(comm: GroupComm, device: torch.device, label: str, call, async_op: bool):
    if async_op:
        work = call()
        return None if work is None else _TimedWork(work, comm, device, label)
    with _timed(comm, device, label):
        return call()


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
        call = super().__call__
        return _call_timed(
            self.comm,
            output_tensor.device,
            "dp.all_gather.fsdp_params",
            lambda: call(output_tensor, input_tensor, group, async_op),
            async_op,
        )


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
        call = super().__call__
        return _call_timed(
            self.comm,
            output_tensor.device,
            "dp.reduce_scatter.fsdp_grads",
            lambda: call(output_tensor, input_tensor, group, op, async_op),
            async_op,
        )


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.dtype``.

    bfloat16: parameters are all-gathered and computed in bf16 (half the bytes and half the
    gathered memory), gradients reduced in fp32; the sharded fp32 parameters stay the master
    weights the optimizer updates. The stage's outputs are fp32, as a pipeline boundary
    expects. float32: FSDP's default, no casts.
    """
    if dtype != "bfloat16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )


def apply_data_parallel(
    part: TensorParallelModel, comms: MeshComms, mode: str, dtype: str = "float32"
) -> None:
    """``fully_shard`` each block, the embedding and the head, then the stage (final norm).

    The embedding and the head are units of their own (unless tied: one parameter cannot be
    in two units): inside the stage's root unit they would stay gathered, with their full
    gradients, through the whole backward of the stage; as units they are gathered only
    around their own forward and backward and their gradients are reduced as soon as their
    backward ends. The traffic is the same: the root unit is resharded after forward too.
    """
    reshard = mode == "fsdp"
    model = part.model
    own = [] if model.cfg.tie_embeddings else [model.embed_tokens, model.lm_head]
    modules = [*model.layers.values(), *(m for m in own if m is not None), part]
    block_policy = mixed_precision(dtype)
    # Only the stage's own outputs go back to fp32; blocks hand bf16 to each other.
    block_policy = MixedPrecisionPolicy(
        param_dtype=block_policy.param_dtype, reduce_dtype=block_policy.reduce_dtype
    )
    for module in modules:
        policy = mixed_precision(dtype) if module is part else block_policy
        fully_shard(module, mesh=comms.dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for module in modules:
        assert isinstance(module, FSDPModule)
        module.set_custom_all_gather(_RecordedAllGather(comms.dp))
        module.set_custom_reduce_scatter(_RecordedReduceScatter(comms.dp))
