"""The ``(pp, dp, tp)`` device mesh and the explicit process groups cut from it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from boostlr.config import ParallelConfig
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.device import HOST_BACKEND, backend_for, group_options

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshComms:
    """The mesh, one :class:`GroupComm` per dim (all recording into one ledger)."""

    mesh: DeviceMesh | None
    tp: GroupComm
    dp: GroupComm
    pp: GroupComm
    ledger: CommLedger
    # All ranks on gloo, for checkpoint saves and loads only: an async save's collectives
    # then never interleave with training's (and work beside NCCL on GPUs). Its timeout is
    # ``parallel.timeout_s`` until the trainer sizes it to the checkpoint
    # (:meth:`with_ckpt_timeout`).
    ckpt_group: dist.ProcessGroup | None = None
    ckpt_timeout_s: float | None = None

    def with_ckpt_timeout(self, timeout_s: float) -> MeshComms:
        """These comms with a new checkpoint group that waits ``timeout_s`` (collective over
        every rank; the old group is destroyed). A group's timeout is fixed when it is
        made, so the group is made again rather than changed."""
        if self.ckpt_group is None:
            return self
        group = dist.new_group(backend=HOST_BACKEND, timeout=timedelta(seconds=timeout_s))
        dist.destroy_process_group(self.ckpt_group)
        return replace(self, ckpt_group=group, ckpt_timeout_s=timeout_s)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh["dp"]


def single_process_comms() -> MeshComms:
    """Every dim of size 1: the plain model in one process, no collective."""
    ledger = CommLedger()
    return MeshComms(None, *(GroupComm(None, name, ledger) for name in ("tp", "dp", "pp")), ledger)


def build_mesh(p: ParallelConfig, device: torch.device) -> MeshComms:
    """A named ``(pp, dp, tp)`` mesh over the default group (which must already exist).

    Ranks are laid out tp-fastest, so a tensor-parallel group sits on one node's GPUs. Every
    group gets ``parallel.timeout_s``: left alone, torch gives subgroups a 30-minute timeout
    whatever the default group has (docs/design.md §5).
    """
    timeout = timedelta(seconds=p.timeout_s)
    backend = backend_for(device)
    override = {name: (backend, group_options(backend, timeout)) for name in MESH_DIMS}
    mesh = init_device_mesh(
        device.type, (p.pp, p.dp, p.tp), mesh_dim_names=MESH_DIMS, backend_override=override
    )
    ledger = CommLedger()
    comms = {name: GroupComm(mesh.get_group(name), name, ledger) for name in MESH_DIMS}
    ckpt_group = dist.new_group(backend=HOST_BACKEND, timeout=timeout)
    return MeshComms(mesh, comms["tp"], comms["dp"], comms["pp"], ledger, ckpt_group, p.timeout_s)
