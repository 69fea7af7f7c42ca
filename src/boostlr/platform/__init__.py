"""The platform: everything that differs between device kinds, on the ground floor.

One :class:`Platform` per kind (:class:`HostPlatform`: a CPU rank on gloo;
:class:`CudaPlatform`: a GPU rank on NCCL) answers which backend a device's groups use,
which GPU a rank drives, how a region of the step is timed, how the host waits, how memory
is read, how a batch crosses to the device, how a checkpoint stages and which generators it
keeps. Callers pick one with :func:`platform_for` and never branch on ``device.type`` or a
backend name (``tests/test_structure.py`` holds the tree to it); a new device kind is one
new class in :mod:`boostlr.platform.registry`. The platform imports nothing of boostlr's
above it, so data, checkpoints, the engine and the trainer can all stand on it.
"""

from boostlr.platform.base import CopyLane, CopyPlan, Platform
from boostlr.platform.copies import HostToDevice, copy_steps, host_buffer, to_device
from boostlr.platform.cuda import CudaPlatform, local_device_index, no_gpu_message
from boostlr.platform.host import HOST_BACKEND, HostPlatform
from boostlr.platform.registry import (
    PLATFORMS,
    bind_thread_device,
    fsdp_in_place_collectives,
    host_platform,
    pin_staging,
    platform_for,
    platform_of_backend,
    resolve_device,
    rng_states,
    set_rng_states,
)
from boostlr.platform.timing import EventTimer, WallTimer

__all__ = [
    "HOST_BACKEND",
    "PLATFORMS",
    "CopyLane",
    "CopyPlan",
    "CudaPlatform",
    "EventTimer",
    "HostPlatform",
    "HostToDevice",
    "Platform",
    "WallTimer",
    "bind_thread_device",
    "copy_steps",
    "fsdp_in_place_collectives",
    "host_buffer",
    "host_platform",
    "local_device_index",
    "no_gpu_message",
    "pin_staging",
    "platform_for",
    "platform_of_backend",
    "resolve_device",
    "rng_states",
    "set_rng_states",
    "to_device",
]
