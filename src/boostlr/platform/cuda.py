"""The CUDA platform: a rank that drives one GPU of its own and talks over NCCL.

The host only queues work here, so timing uses events, a sync is a real wait, memory is the
caching allocator's, and batches are copied from pinned memory on a side stream.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from boostlr.errors import ConfigError
from boostlr.platform.base import CopyLane, CopyPlan, Platform
from boostlr.platform.timing import EventTimer, WallTimer

CUDA = "cuda"
GPU_BACKEND = "nccl"
UNSET = "<unset>"


def no_gpu_message(env: Mapping[str, str], rank: str | None = None) -> str:
    """The one line for a rank that was asked for a GPU and sees none."""
    who = f"rank {rank}" if rank is not None else "this process"
    visible = env.get("CUDA_VISIBLE_DEVICES", UNSET)
    return (
        f"--parallel.device cuda but {who} sees no CUDA GPU (CUDA_VISIBLE_DEVICES={visible}): "
        "give every rank a GPU (srun --gpus-per-task=1, or --gpus-per-node with one task "
        "per GPU) or use --parallel.device cpu"
    )


def local_device_index(
    local_rank: int, device_count: int, env: Mapping[str, str], local_world: int | None = None
) -> int:
    """The GPU (among those this rank sees) that local rank ``local_rank`` drives.

    ``local_rank % device_count``: with every GPU of the node visible that is the local rank;
    where the site shows each task only its own GPU (``srun --gpus-per-task=1``,
    ``--gpu-bind=single:1``, a ``CUDA_VISIBLE_DEVICES`` per task) it is 0. ``local_world``
    is known where one launcher starts the node's ranks with the same view of the GPUs
    (torchrun, boostlr's own launch: ``LOCAL_WORLD_SIZE``); fewer GPUs than ranks is then
    refused here, as NCCL would fail later with a less helpful message.
    """
    if device_count < 1:
        raise ConfigError(no_gpu_message(env, env.get("RANK")))
    if local_world is not None and device_count < local_world:
        visible = env.get("CUDA_VISIBLE_DEVICES", UNSET)
        raise ConfigError(
            f"{local_world} ranks on this node but rank {env.get('RANK', '?')} sees "
            f"{device_count} GPU(s) (CUDA_VISIBLE_DEVICES={visible}): NCCL needs one GPU per "
            "rank; start as many ranks per node as it has GPUs"
        )
    return local_rank % device_count


class StreamLane(CopyLane):
    """Copies queued on a side stream of ``device``: the next batch's copy runs while the
    current one computes. :meth:`hand_over` makes the compute stream wait for them (on the
    device, not the host) and tells the allocator they are used there."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device)

    def queued(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream)

    def hand_over(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for t in tensors:
            t.record_stream(current)
        return tensors


# Compute capability majors of torch's grouped GEMM kernel (``_scaled_mm_allowed_device``
# with sm90 and sm100).
GROUPED_MM_MAJORS = (9, 10)


@functools.cache
def _grouped_capability(index: int | None) -> bool:
    """Whether GPU ``index`` (``None``: the current one) has the grouped GEMM kernel; asked
    once per GPU."""
    return torch.cuda.get_device_capability(index)[0] in GROUPED_MM_MAJORS


class CudaPlatform(Platform):
    """A CUDA rank (NCCL)."""

    kind = CUDA
    backend = GPU_BACKEND
    is_host = False
    copy_plan = CopyPlan(pin=True, non_blocking=True, side_stream=True)
    # Enough counters per step of the init draw to fill a GPU.
    draw_chunk_counters = 1 << 22
    # NCCL writes ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` in place, so
    # FSDP's own calls stay.
    fsdp_in_place_collectives = False

    def available(self) -> bool:
        return torch.cuda.is_available()

    def check_available(self, env: Mapping[str, str]) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(no_gpu_message(env, env.get("RANK")))

    def bind_rank(self, device: torch.device, env: Mapping[str, str]) -> torch.device:
        """``cuda:(LOCAL_RANK % device_count)``, made current (NCCL binds to it)."""
        local_world = env.get("LOCAL_WORLD_SIZE")
        index = local_device_index(
            int(env.get("LOCAL_RANK", "0")),
            torch.cuda.device_count(),
            env,
            int(local_world) if local_world else None,
        )
        bound = torch.device(CUDA, index)
        torch.cuda.set_device(bound)
        return bound

    def bind_thread(self, device: torch.device) -> None:
        """CUDA's current device is per host thread and a new thread starts on device 0: a
        background thread of the rank (an async checkpoint's writer) that touched CUDA
        before this would create a context on GPU 0, from every rank of the node."""
        if device.index is not None:
            torch.cuda.set_device(device)

    def check_local_ranks(self, ranks: int) -> None:
        local_device_index(ranks - 1, torch.cuda.device_count(), os.environ, ranks)

    def claim(self, index: int) -> torch.device:
        device = torch.device(CUDA, index)
        torch.cuda.set_device(device)
        return device

    def can_pair(self) -> bool:
        return torch.cuda.device_count() >= 2

    def grouped_mm_runs(self, device: torch.device, dtype: torch.dtype) -> bool:
        """torch's CUDA grouped GEMM has its own kernel (no host read) for bf16 on compute
        capability 9.x and 10.x only (``_grouped_mm_cuda``'s fast path, torch 2.11 and
        2.13); elsewhere (an A100's 8.0, fp32) it copies the offsets to the host and loops
        over the groups, so boostlr runs the experts padded instead."""
        return dtype == torch.bfloat16 and _grouped_capability(device.index)

    def accelerator_name(self, device: torch.device) -> str | None:
        return torch.cuda.get_device_name(device)

    def describe(self, device: torch.device) -> tuple[str, float, int]:
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        return torch.cuda.get_device_name(device), memory, torch.cuda.device_count()

    def profiler_activities(self) -> list[ProfilerActivity]:
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def process_group_kwargs(self, device: torch.device) -> dict[str, Any]:
        """With ``device_id`` NCCL creates its communicator at init (eagerly, and able to
        split subgroups from it) instead of inside the first collective of the step."""
        kwargs: dict[str, Any] = {"backend": self.backend}
        if device.index is not None:
            kwargs["device_id"] = device
        return kwargs

    def backend_options(self) -> dist.ProcessGroup.Options:
        return dist.ProcessGroupNCCL.Options()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def allocated_bytes(self, device: torch.device) -> int | None:
        return torch.cuda.memory_allocated(device)

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_allocated(self, device: torch.device) -> bool:
        torch.cuda.reset_peak_memory_stats(device)
        return True

    @contextmanager
    def sync_debug(self, device: torch.device, mode: str | int = "error") -> Iterator[None]:
        """The body under ``torch.cuda.set_sync_debug_mode(mode)``."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def region_timer(self) -> WallTimer:
        return EventTimer(lambda: torch.cuda.Event(enable_timing=True))

    def copy_lane(self, device: torch.device) -> CopyLane:
        return StreamLane(device)

    def pin_staging(self) -> bool:
        """The copy out of device memory then runs at full bandwidth."""
        return self.copy_plan.pin and torch.cuda.is_available()

    def rng_states(self) -> dict[str, torch.Tensor]:
        """Each visible GPU's generator as ``cuda{i}``."""
        if not torch.cuda.is_available():
            return {}
        return {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}

    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None:
        """GPUs this process does not see are skipped (a resume may see fewer GPUs per task
        than the save did)."""
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                if f"cuda{i}" in states:
                    torch.cuda.set_rng_state(states[f"cuda{i}"], i)
