"""Utilisation for the metrics log: the device's peak FLOP/s (for MFU) and peak memory.

GPU peaks come from the cost model's shipped hardware profiles, matched by the CUDA device
name. A CPU has no data sheet we can trust (turbo, AVX-512/AMX, shared cores), so its peak is
the ``local`` profile that ``boostlr calibrate`` measured on this machine; without one MFU is
left out of the log rather than guessed.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

from boostlr.analysis.hardware import load_profile, user_dir
from boostlr.errors import ConfigError
from boostlr.platform import platform_for

# Substrings of ``torch.cuda.get_device_name()`` -> shipped profile (first match wins).
GPU_PROFILES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("H200",), "h200"),
    (("H100", "SXM"), "h100-sxm"),
    (("H100", "HBM3"), "h100-sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (("A100", "80GB"), "a100-80gb"),
    (("A100",), "a100-40gb"),
)


def gpu_profile_name(device_name: str) -> str | None:
    """The shipped profile for a CUDA device name, or ``None`` (e.g. H100 PCIe, consumer GPUs)."""
    for needles, profile in GPU_PROFILES:
        if all(n in device_name for n in needles):
            return profile
    return None


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense-matmul peak FLOP/s of one device in ``dtype`` (``float32``/``bfloat16``), if known.

    fp32 on NVIDIA GPUs is the non-tensor-core peak (TF32 off, torch's default for matmuls).
    """
    platform = platform_for(device)
    accelerator = platform.accelerator_name(device)
    if accelerator is not None:
        name = gpu_profile_name(accelerator)
    else:
        name = "local" if (user_dir() / "local.toml").is_file() else None
    if name is None:
        return None
    try:
        profile = load_profile(name)
    except ConfigError:
        return None
    peak = profile.flops(dtype)
    if platform.is_host:
        # calibrate measures with ``threads`` torch threads; this process may use more, and a
        # one-thread peak would then overstate MFU.
        measured_threads = int(profile.extra.get("threads", 1) or 1)
        peak *= torch.get_num_threads() / measured_threads
    return peak


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the allocator's high-water mark; CPU: the process's high-water RSS (MiB)."""
    peak = platform_for(device).peak_allocated_bytes(device)
    if peak is not None:
        return peak / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes vs KiB


def build_times(stages: list, group: dist.ProcessGroup | None) -> dict[str, float | list[float]]:
    """``build_s`` (the slowest rank's) and ``build_s_ranks``: seconds to build each rank's part.

    Gathered once, on the first log step after a start, over ``group``, the all-ranks gloo
    group (the checkpoint writer's), with host tensors: no device copy, no device sync.
    """
    mine = max((getattr(s, "build_s", 0.0) for s in stages), default=0.0)
    local = torch.tensor([mine], dtype=torch.float64)
    times = [local]
    if group is not None and dist.get_world_size(group) > 1:
        times = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(times, local, group=group)
    per_rank = [round(t.item(), 3) for t in times]
    return {"build_s": max(per_rank), "build_s_ranks": per_rank}
