"""The device mesh, its named dims, and the explicit process groups cut from it.

:func:`mesh_shape` is the one place the mesh's dims are named and sized; everything else
reaches a dim's group by name (:meth:`MeshComms.group`), so a further dim (an expert dim
carved out of dp) is an entry there and a config key, not a field in every caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from boostlr._torch_internals import unflatten_mesh
from boostlr.config import ParallelConfig
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.platform import platform_for


def mesh_shape(p: ParallelConfig) -> dict[str, int]:
    """Each mesh dim's size by name, outermost first: ranks are laid out with the last dim
    fastest, so a tensor-parallel group sits on one node's GPUs."""
    return {"pp": p.pp, "dp": p.dp, "tp": p.tp}


MESH_DIMS: tuple[str, ...] = tuple(mesh_shape(ParallelConfig()))


def expert_mesh_shape(p: ParallelConfig) -> dict[str, int]:
    """The mesh as the routed experts see it: dp split into ``dp_rep x ep``, ``ep`` inner.

    Not a fourth dim of :func:`mesh_shape`: everything but the experts (FSDP, the data
    loader, the vocab split) keeps seeing one ``dp`` dim. The ``ep`` ranks are ``ep``
    consecutive dp ranks; ``dp_rep`` indexes the replicas of one expert shard.
    """
    shape = mesh_shape(p)
    return {"pp": shape["pp"], "dp_rep": shape["dp"] // p.ep, "ep": p.ep, "tp": shape["tp"]}


EXPERT_DIMS: tuple[str, ...] = ("dp_rep", "ep")


def mesh_coordinates(p: ParallelConfig, rank: int) -> dict[str, int]:
    """A global rank's index along each mesh dim (the last dim fastest, as the mesh lays
    ranks out)."""
    at: dict[str, int] = {}
    for name, size in reversed(mesh_shape(p).items()):
        rank, at[name] = divmod(rank, size)
    return {name: at[name] for name in mesh_shape(p)}


@dataclass(frozen=True)
class MeshComms:
    """The mesh and one :class:`GroupComm` per named dim (all recording into one ledger).

    Only the mesh's groups: the checkpoint group is the checkpoint writer's own
    (:class:`~boostlr.rundir.timeouts.CheckpointGroup`).
    """

    mesh: DeviceMesh | None
    groups: Mapping[str, GroupComm]
    ledger: CommLedger
    #: :func:`expert_mesh_shape`'s mesh, the same ranks with dp unflattened (``ep > 1``).
    expert_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", MappingProxyType(dict(self.groups)))

    def group(self, dim: str) -> GroupComm:
        """The group of mesh dim ``dim``."""
        if dim not in self.groups:
            raise KeyError(f"the mesh has no dim {dim!r} (its dims: {', '.join(self.groups)})")
        return self.groups[dim]

    def dim_mesh(self, *dims: str) -> DeviceMesh | None:
        """The sub-mesh over ``dims`` (``None`` without a mesh: one process); ``ep`` and
        ``dp_rep`` are dims of :attr:`expert_mesh`."""
        mesh = self.expert_mesh if set(dims) & set(EXPERT_DIMS) else self.mesh
        if mesh is None:
            return None
        return mesh[dims if len(dims) > 1 else dims[0]]

    @property
    def ep(self) -> GroupComm:
        """The expert-parallel group; size 1 (no collective) when the run has none."""
        return self.groups.get("ep") or GroupComm(None, "ep", self.ledger)

    @property
    def tp(self) -> GroupComm:
        return self.group("tp")

    @property
    def dp(self) -> GroupComm:
        return self.group("dp")

    @property
    def pp(self) -> GroupComm:
        return self.group("pp")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.dim_mesh("tp")

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self.dim_mesh("dp")


def comms_on(mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> MeshComms:
    """One :class:`GroupComm` per dim of ``mesh``, named as the dim, on one new ledger, and
    the ``dp_rep`` and ``ep`` groups of ``expert_mesh`` when given."""
    ledger = CommLedger()
    names = mesh.mesh_dim_names or ()
    groups = {name: GroupComm(mesh.get_group(name), name, ledger) for name in names}
    if expert_mesh is not None:
        for name in EXPERT_DIMS:
            groups[name] = GroupComm(expert_mesh.get_group(name), name, ledger)
    return MeshComms(mesh, groups, ledger, expert_mesh)


def unflatten_experts(mesh: DeviceMesh, p: ParallelConfig) -> DeviceMesh:
    """``mesh`` with its dp dim split as :func:`expert_mesh_shape` says: the same ranks, new
    groups, one root mesh (so DTensors on the ``ep`` sub-mesh and FSDP on ``dp`` belong to
    one mesh), by torch's private unflatten (:func:`~boostlr._torch_internals.unflatten_mesh`)."""
    shape = expert_mesh_shape(p)
    platform = platform_for(torch.device(mesh.device_type))
    options = platform.group_options(timedelta(seconds=p.timeout_s))  # as build_mesh's
    override = {name: (platform.backend, options) for name in EXPERT_DIMS}
    return unflatten_mesh(mesh, "dp", tuple(shape[n] for n in EXPERT_DIMS), EXPERT_DIMS, override)


def single_process_comms() -> MeshComms:
    """Every dim of size 1: the plain model in one process, no collective."""
    ledger = CommLedger()
    return MeshComms(None, {name: GroupComm(None, name, ledger) for name in MESH_DIMS}, ledger)


def build_mesh(p: ParallelConfig, device: torch.device) -> MeshComms:
    """The named mesh of :func:`mesh_shape` over the default group (which must already exist).

    Every group gets ``parallel.timeout_s``: left alone, torch gives subgroups a 30-minute
    timeout whatever the default group has (docs/design.md §5).
    """
    shape = mesh_shape(p)
    timeout = timedelta(seconds=p.timeout_s)
    platform = platform_for(device)
    override = {name: (platform.backend, platform.group_options(timeout)) for name in shape}
    mesh = init_device_mesh(
        device.type,
        tuple(shape.values()),
        mesh_dim_names=tuple(shape),
        backend_override=override,
    )
    return comms_on(mesh, unflatten_experts(mesh, p) if p.ep > 1 else None)
