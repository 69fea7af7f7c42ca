"""The ``(pp, dp, tp)`` device mesh and the explicit process groups cut from it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from boostlr.config import ParallelConfig
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.platform import platform_for
from boostlr.rundir.timeouts import CheckpointGroup, remade_group

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
        """These comms with the checkpoint group waiting ``timeout_s`` (collective over every
        rank when it changes). A group's timeout is fixed when it is made, so the group is
        made again, the old one destroyed first (:func:`~boostlr.rundir.timeouts.remade_group`)."""
        if self.ckpt_group is None or timeout_s == self.ckpt_timeout_s:
            return self
        group = remade_group(self.ckpt_group, timeout_s)
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


def build_mesh(
    p: ParallelConfig, device: torch.device, ckpt: CheckpointGroup | None = None
) -> MeshComms:
    """A named ``(pp, dp, tp)`` mesh over the default group (which must already exist).

    Ranks are laid out tp-fastest, so a tensor-parallel group sits on one node's GPUs. Every
    group gets ``parallel.timeout_s``: left alone, torch gives subgroups a 30-minute timeout
    whatever the default group has (docs/design.md §5). The checkpoint group is taken over
    from ``ckpt`` (the one resume verified on) when that holds one, else made here.
    """
    timeout = timedelta(seconds=p.timeout_s)
    platform = platform_for(device)
    override = {name: (platform.backend, platform.group_options(timeout)) for name in MESH_DIMS}
    mesh = init_device_mesh(
        device.type, (p.pp, p.dp, p.tp), mesh_dim_names=MESH_DIMS, backend_override=override
    )
    ledger = CommLedger()
    comms = {name: GroupComm(mesh.get_group(name), name, ledger) for name in MESH_DIMS}
    ckpt_group, ckpt_timeout_s = ckpt.take() if ckpt is not None else (None, None)
    if ckpt_group is None:
        ckpt_group, ckpt_timeout_s = remade_group(None, p.timeout_s), p.timeout_s
    return MeshComms(
        mesh, comms["tp"], comms["dp"], comms["pp"], ledger, ckpt_group, ckpt_timeout_s
    )
