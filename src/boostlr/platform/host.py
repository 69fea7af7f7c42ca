"""The host platform: a rank that computes on the CPU itself and talks over gloo.

Nothing to bind, nothing queued (timing is wall time, syncs are free), no device allocator
(memory is the process's RSS, read by the caller), and copies are plain calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from boostlr._torch_internals import gloo_options
from boostlr.models.philox import HOST_CHUNK_COUNTERS
from boostlr.platform.base import CopyLane, CopyPlan, Platform
from boostlr.platform.timing import WallTimer

HOST = "cpu"
# Collectives of host tensors: CPU training, and the checkpoint group beside NCCL on GPUs.
HOST_BACKEND = "gloo"
# The dtypes of torch's CPU grouped GEMM.
HOST_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HostPlatform(Platform):
    """A CPU rank (gloo)."""

    kind = HOST
    backend = HOST_BACKEND
    is_host = True
    copy_plan = CopyPlan(pin=False, non_blocking=False, side_stream=False)
    # The CPU's cache-sized default of the counter-based draw.
    draw_chunk_counters = HOST_CHUNK_COUNTERS
    # gloo implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a
    # temporary the size of the whole buffer.
    fsdp_in_place_collectives = True

    def available(self) -> bool:
        return True

    def check_available(self, env: Mapping[str, str]) -> None:
        return None  # every process has a CPU

    def bind_rank(self, device: torch.device, env: Mapping[str, str]) -> torch.device:
        return device

    def bind_thread(self, device: torch.device) -> None:
        return None  # no per-thread current device

    def check_local_ranks(self, ranks: int) -> None:
        return None  # CPU ranks share the machine's cores

    def claim(self, index: int) -> torch.device:
        return torch.device(HOST)

    def can_pair(self) -> bool:
        return True

    def accelerator_name(self, device: torch.device) -> str | None:
        return None

    def describe(self, device: torch.device) -> tuple[str, float, int]:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return "this machine's CPU", float(ram), os.cpu_count() or 1

    def profiler_activities(self) -> list[ProfilerActivity]:
        return [ProfilerActivity.CPU]

    def process_group_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {"backend": self.backend}

    def backend_options(self) -> dist.ProcessGroup.Options:
        return gloo_options()

    def synchronize(self, device: torch.device) -> None:
        return None  # the host ran it already

    def allocated_bytes(self, device: torch.device) -> int | None:
        return None

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return None

    def reset_peak_allocated(self, device: torch.device) -> bool:
        return False

    @contextmanager
    def sync_debug(self, device: torch.device, mode: str | int = "error") -> Iterator[None]:
        yield  # nothing to wait on

    def region_timer(self) -> WallTimer:
        return WallTimer()

    def grouped_mm_runs(self, device: torch.device, dtype: torch.dtype) -> bool:
        """The CPU kernel takes fp32, bf16 and fp16 (not float64); its offsets are on the host
        already."""
        return dtype in HOST_GROUPED_DTYPES

    def copy_lane(self, device: torch.device) -> CopyLane:
        return CopyLane()

    def pin_staging(self) -> bool:
        return False  # nothing crosses a bus

    def rng_states(self) -> dict[str, torch.Tensor]:
        return {HOST: torch.get_rng_state()}

    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(states[HOST])
