"""The protocol every device kind implements: what differs between a CPU rank (gloo) and a
CUDA rank (NCCL), as one class per kind.

The rest of boostlr asks a :class:`Platform` (``platform_for(device)``) instead of branching
on ``device.type`` or a backend name; a new device kind is one new subclass, registered in
:mod:`boostlr.platform.registry`. A kind that forgets a fact or a method fails where it is
defined or registered, not on the first rank that needs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from boostlr._torch_internals import set_group_timeout
from boostlr.platform.timing import WallTimer


@dataclass(frozen=True)
class CopyPlan:
    """How a batch crosses from host to a device without the host waiting.

    ``pin``: build it in page-locked memory (a pageable source makes the driver stage the
    copy synchronously); ``non_blocking``: the copy is only queued; ``side_stream``: queued
    on a stream of its own, so the next batch's copy runs while the current one computes.
    """

    pin: bool
    non_blocking: bool
    side_stream: bool


class CopyLane:
    """Where a device's batch copies are queued and how they are handed to the compute.

    This one is the host's: copies are plain calls and a batch is ready once copied.
    """

    def queued(self) -> AbstractContextManager[Any]:
        """The body's copies are queued on this lane."""
        return nullcontext()

    def hand_over(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``tensors``, made safe to compute on."""
        return tensors


# The class attributes every kind sets (annotated on :class:`Platform`).
FACTS = (
    "kind",
    "backend",
    "is_host",
    "copy_plan",
    "draw_chunk_counters",
    "fsdp_in_place_collectives",
)


class Platform(ABC):
    """One device kind: its backend, binding, timing, memory, copies and generators.

    Class attributes are the facts; methods the calls. Methods that take a ``device`` get
    one of this kind (its index may matter).
    """

    kind: ClassVar[str]  # ``torch.device.type``
    backend: ClassVar[str]  # the collective backend of tensors on it
    is_host: ClassVar[bool]  # the model computes on the CPU itself
    copy_plan: ClassVar[CopyPlan]
    # Counters per step of the counter-based init draw (values are the same at any size).
    draw_chunk_counters: ClassVar[int]
    # FSDP's gathers and reductions run through boostlr's in-place calls on this backend.
    fsdp_in_place_collectives: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A kind that leaves one of the facts above unset is refused where it is defined."""
        super().__init_subclass__(**kwargs)
        missing = [name for name in FACTS if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"platform {cls.__name__} leaves {', '.join(missing)} unset")

    # ------------------------------------------------------------------ which device

    @abstractmethod
    def available(self) -> bool:
        """This process can compute on a device of this kind."""

    @abstractmethod
    def check_available(self, env: Mapping[str, str]) -> None:
        """Raise a one-line ``ConfigError`` when asked for this kind and none is visible."""

    @abstractmethod
    def bind_rank(self, device: torch.device, env: Mapping[str, str]) -> torch.device:
        """This rank's own device, made current (before the process group exists)."""

    @abstractmethod
    def bind_thread(self, device: torch.device) -> None:
        """Make ``device`` current in the calling thread (a rank's background thread)."""

    @abstractmethod
    def check_local_ranks(self, ranks: int) -> None:
        """Before boostlr starts ``ranks`` ranks on this node: each can have a device."""

    @abstractmethod
    def claim(self, index: int) -> torch.device:
        """Device ``index``, made current for a process that drives one of its own."""

    @abstractmethod
    def can_pair(self) -> bool:
        """Two processes can each own a device of this kind."""

    @abstractmethod
    def accelerator_name(self, device: torch.device) -> str | None:
        """The accelerator's marketing name (matched against shipped profiles), or ``None``."""

    @abstractmethod
    def describe(self, device: torch.device) -> tuple[str, float, int]:
        """(name, memory bytes, devices per node) of what a hardware profile describes."""

    @abstractmethod
    def profiler_activities(self) -> list[ProfilerActivity]:
        """What ``torch.profiler`` records for a rank on this kind."""

    # ------------------------------------------------------------------ process groups

    @abstractmethod
    def process_group_kwargs(self, device: torch.device) -> dict[str, Any]:
        """``init_process_group`` arguments for a rank bound to ``device``."""

    @abstractmethod
    def backend_options(self) -> dist.ProcessGroup.Options:
        """Fresh options of :attr:`backend`'s process groups."""

    def group_options(self, timeout: timedelta) -> dist.ProcessGroup.Options:
        """Backend options carrying ``timeout`` (the only way to give a mesh dim one)."""
        options = self.backend_options()
        set_group_timeout(options, timeout)
        return options

    # ------------------------------------------------------------------ waiting, memory

    @abstractmethod
    def synchronize(self, device: torch.device) -> None:
        """Wait until ``device`` has run everything queued (a host sync: log steps only)."""

    @abstractmethod
    def allocated_bytes(self, device: torch.device) -> int | None:
        """The device allocator's bytes in use; ``None`` where the caller reads the RSS."""

    @abstractmethod
    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        """The device allocator's high-water mark; ``None`` where there is none."""

    @abstractmethod
    def reset_peak_allocated(self, device: torch.device) -> bool:
        """Start a new high-water mark; ``False`` where there is no device allocator."""

    @abstractmethod
    def sync_debug(
        self, device: torch.device, mode: str | int = "error"
    ) -> AbstractContextManager[None]:
        """A context in which any call that makes the host wait on ``device`` raises
        (``mode="error"``): for checks that a stretch of the step never syncs."""

    @abstractmethod
    def region_timer(self) -> WallTimer:
        """The timer for regions of work on this kind."""

    # ------------------------------------------------------------------ kernels

    @abstractmethod
    def grouped_mm_runs(self, device: torch.device, dtype: torch.dtype) -> bool:
        """torch's grouped GEMM (``torch.nn.functional.grouped_mm``) runs on ``device`` in
        ``dtype`` without reading its offsets back to the host: the MoE experts run grouped
        there, and padded elsewhere (:mod:`boostlr.hf.moe_grouped`). Decided once per
        device and dtype."""

    # ------------------------------------------------------------------ copies, generators

    @abstractmethod
    def copy_lane(self, device: torch.device) -> CopyLane:
        """Where :class:`~boostlr.platform.copies.HostToDevice` queues copies to ``device``."""

    @abstractmethod
    def pin_staging(self) -> bool:
        """A checkpoint save stages this kind's tensors into pinned host memory."""

    @abstractmethod
    def rng_states(self) -> dict[str, torch.Tensor]:
        """The generators of this kind the process sees, each under its checkpoint key."""

    @abstractmethod
    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None:
        """Put back this kind's generators from what :meth:`rng_states` kept."""
