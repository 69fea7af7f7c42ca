"""Everything that differs between a CPU rank (gloo) and a CUDA rank (NCCL), in one place.

The rest of boostlr asks this module instead of branching on ``device.type`` or a backend
name: which backend a device's groups use, which GPU a rank drives, how a region of the
step is timed, how the host waits for the device, how memory is read, which FSDP
collectives gloo needs, and how a batch crosses from host to device without the host
waiting. A new device kind is then one edit here (``tests/test_structure.py`` holds the
rest of the tree to it).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from boostlr._torch_internals import gloo_options, set_group_timeout
from boostlr.errors import ConfigError
from boostlr.models.philox import HOST_CHUNK_COUNTERS

CUDA = "cuda"
HOST = "cpu"
GPU_BACKEND = "nccl"
# Collectives of host tensors: CPU training, and the checkpoint group beside NCCL on GPUs.
HOST_BACKEND = "gloo"
UNSET = "<unset>"


# ----------------------------------------------------------------------------- which device


def runs_on_host(device: torch.device | str) -> bool:
    """The model computes on the CPU itself (no accelerator to queue work on)."""
    return torch.device(device).type == HOST


def resolve_device(name: str, env: Mapping[str, str] | None = None) -> torch.device:
    """``parallel.device`` (``auto``/``cpu``/``cuda``) as a torch device; checked before any
    rank starts, so a missing GPU is one line, not a traceback from the first kernel."""
    if name == "auto":
        return torch.device(CUDA if torch.cuda.is_available() else HOST)
    if name == CUDA and not torch.cuda.is_available():
        env = os.environ if env is None else env
        raise ConfigError(no_gpu_message(env, env.get("RANK")))
    return torch.device(name)


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


def bind_rank_device(device: torch.device, env: Mapping[str, str] | None = None) -> torch.device:
    """This rank's own device, made current: ``cuda:(LOCAL_RANK % device_count)``, or the
    CPU unchanged. Called before the process group exists (NCCL binds to it)."""
    if runs_on_host(device):
        return device
    env = os.environ if env is None else env
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


def bind_thread_device(device: torch.device | None) -> None:
    """Make this rank's ``device`` current in the calling thread (nothing on a CPU).

    CUDA's current device is per host thread and a new thread starts on device 0: a
    background thread of the rank (an async checkpoint's writer) that touched CUDA before
    this would create a context on GPU 0, from every rank of the node.
    """
    if device is not None and not runs_on_host(device) and device.index is not None:
        torch.cuda.set_device(device)


def check_local_gpus(device: torch.device, ranks: int) -> None:
    """Before boostlr starts ``ranks`` ranks on this node itself: one GPU each is visible."""
    if not runs_on_host(device):
        local_device_index(ranks - 1, torch.cuda.device_count(), os.environ, ranks)


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's marketing name (matched against shipped profiles); ``None`` on a CPU."""
    return None if runs_on_host(device) else torch.cuda.get_device_name(device)


def init_draw_counters(device: torch.device) -> int:
    """Counters per step of the counter-based init draw on ``device``: the CPU's cache-sized
    default, or enough to fill a GPU (values are the same either way)."""
    return HOST_CHUNK_COUNTERS if runs_on_host(device) else 1 << 22


def claim_device(kind: str, index: int) -> torch.device:
    """Device ``index`` of ``kind``, made current for a process that drives one GPU of its
    own (calibrate's all-reduce pair); the CPU as it is."""
    if runs_on_host(kind):
        return torch.device(HOST)
    device = torch.device(kind, index)
    torch.cuda.set_device(device)
    return device


def can_pair(device: torch.device) -> bool:
    """Two processes can each own a device of this kind (a CPU always; GPUs when two are
    visible)."""
    return runs_on_host(device) or torch.cuda.device_count() >= 2


def describe(device: torch.device) -> tuple[str, float, int]:
    """(name, memory bytes, devices per node) of what a hardware profile describes: the GPU's
    name, total memory and visible count, or the machine's RAM and cores on a CPU."""
    if runs_on_host(device):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return "this machine's CPU", float(ram), os.cpu_count() or 1
    memory = float(torch.cuda.get_device_properties(device).total_memory)
    return torch.cuda.get_device_name(device), memory, torch.cuda.device_count()


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    """What ``torch.profiler`` records for a rank on ``device``: the host always, the GPU's
    kernels too where there is one."""
    if runs_on_host(device):
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA]


# ----------------------------------------------------------------------------- process groups


def backend_for(device: torch.device | str) -> str:
    """The collective backend of tensors on ``device``."""
    return HOST_BACKEND if runs_on_host(device) else GPU_BACKEND


def process_group_kwargs(device: torch.device) -> dict[str, Any]:
    """``init_process_group`` arguments for a rank bound to ``device``.

    On CUDA ``device_id`` makes NCCL create its communicator at init (eagerly, and able to
    split subgroups from it) instead of inside the first collective of the step.
    """
    kwargs: dict[str, Any] = {"backend": backend_for(device)}
    if not runs_on_host(device) and device.index is not None:
        kwargs["device_id"] = device
    return kwargs


def group_options(backend: str, timeout: timedelta) -> dist.ProcessGroup.Options:
    """Backend options carrying ``timeout`` (the only way to give a mesh dim a timeout)."""
    options = dist.ProcessGroupNCCL.Options() if backend == GPU_BACKEND else gloo_options()
    set_group_timeout(options, timeout)
    return options


def fsdp_in_place_collectives(backend: str) -> bool:
    """Whether FSDP's gathers and reductions should run through boostlr's in-place calls.

    gloo implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a
    temporary the size of the whole buffer; NCCL writes in place, so FSDP's own calls stay.
    """
    return backend == HOST_BACKEND


# ----------------------------------------------------------------------------- waiting, memory


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued (a host sync: log steps only)."""
    if not runs_on_host(device):
        torch.cuda.synchronize(device)


def allocated_bytes(device: torch.device) -> int | None:
    """The device allocator's bytes in use; ``None`` on a CPU (the caller reads the RSS)."""
    return None if runs_on_host(device) else torch.cuda.memory_allocated(device)


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The device allocator's high-water mark; ``None`` on a CPU."""
    return None if runs_on_host(device) else torch.cuda.max_memory_allocated(device)


def reset_peak_allocated(device: torch.device) -> bool:
    """Start a new high-water mark on the device allocator; ``False`` on a CPU."""
    if runs_on_host(device):
        return False
    torch.cuda.reset_peak_memory_stats(device)
    return True


@contextmanager
def sync_debug(device: torch.device, mode: str | int = "error") -> Iterator[None]:
    """Run the body under ``torch.cuda.set_sync_debug_mode(mode)`` (nothing on a CPU).

    For checks that a stretch of the step never waits on the device: with ``"error"`` any
    synchronising CUDA call inside raises.
    """
    if runs_on_host(device):
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# ----------------------------------------------------------------------------- timing


class WallTimer:
    """Seconds per key of regions that block the host (gloo's calls do): wall time."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add(key, time.perf_counter() - started)

    def _add(self, key: str, seconds: float) -> None:
        self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """Seconds per key since the last call; starts anew."""
        seconds, self._seconds = self._seconds, {}
        return seconds


class EventTimer(WallTimer):
    """Seconds per key of regions on the device's stream, timed by a reused pool of events.

    The host only queues work, so each region records a start and an end event on the
    current stream. Once ``harvest_at`` pairs are pending, each region reads the oldest
    pairs whose end has passed (``query``, never a wait) and stops at the first that has
    not: regions end in stream order, so the newer ones have not either. A region then
    costs one query plus the pairs it reads (each read once), however far the device lags,
    and the pool holds the events of the work still in flight; :meth:`take` waits for the
    rest (a host sync, for log steps).
    """

    def __init__(self, make_event: Callable[[], Any] | None = None, harvest_at: int = 64):
        super().__init__()
        self._make = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.harvest_at = harvest_at
        self._free: list[Any] = []
        self._pending: deque[tuple[str, Any, Any]] = deque()
        self.created = 0  # events made so far: the pool's size

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        self.created += 1
        return self._make()

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = self._event()
        start.record()
        try:
            yield
        finally:
            end = self._event()
            end.record()
            self._pending.append((key, start, end))
            if len(self._pending) >= self.harvest_at:
                self._harvest_finished()

    def _harvest_finished(self) -> None:
        """Read the oldest pairs while their end has passed."""
        while self._pending and self._pending[0][2].query():
            self._read(*self._pending.popleft())

    def _read(self, key: str, start: Any, end: Any) -> None:
        self._add(key, start.elapsed_time(end) / 1e3)
        self._free += [start, end]

    def take(self) -> dict[str, float]:
        while self._pending:
            key, start, end = self._pending.popleft()
            end.synchronize()
            self._read(key, start, end)
        return super().take()


def region_timer(device: torch.device) -> WallTimer:
    """The timer for regions of work on ``device``: wall time on a CPU, events on a GPU."""
    return WallTimer() if runs_on_host(device) else EventTimer()


# ----------------------------------------------------------------------------- host -> device


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


def copy_plan(device_type: str) -> CopyPlan:
    """The plan for copies to a device of type ``device_type`` (a no-op plan on a CPU)."""
    if runs_on_host(device_type):
        return CopyPlan(pin=False, non_blocking=False, side_stream=False)
    return CopyPlan(pin=True, non_blocking=True, side_stream=True)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to fill with data bound for ``device`` (pinned when the plan says)."""
    return torch.empty(shape, dtype=dtype, pin_memory=copy_plan(device.type).pin)


def copy_steps(t: torch.Tensor, device: torch.device) -> tuple[bool, bool] | None:
    """How :func:`to_device` moves ``t`` to ``device``: ``(pin first, non_blocking)``, or
    ``None`` when it is there already. A pure function of the tensor and the target, so a
    CPU-only test can ask what a GPU rank's copy would do."""
    if t.device == device or (t.device.type == device.type and device.index is None):
        return None
    plan = copy_plan(device.type)
    return plan.pin and runs_on_host(t.device) and not t.is_pinned(), plan.non_blocking


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` as its plan says: every batch takes this way.

    A pageable source bound for a GPU is first copied into pinned memory on the host (a
    pageable copy would make the host wait for the device); the training loader builds its
    batches in :func:`host_buffer`, so its batches never need that extra copy.
    """
    steps = copy_steps(t, device)
    if steps is None:
        return t
    pin_first, non_blocking = steps
    if pin_first:
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


class HostToDevice:
    """Starts batches' copies to ``device`` and hands them over when they are needed.

    On a GPU the copies are queued on a side stream; :meth:`ready` makes the compute stream
    wait for them (on the device, not the host) and tells the allocator they are used there.
    On a CPU both are plain calls.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.plan = copy_plan(device.type)
        self._stream = torch.cuda.Stream(device) if self.plan.side_stream else None

    def start(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self._stream is None:
            return tuple(to_device(t, self.device) for t in tensors)
        with torch.cuda.stream(self._stream):
            return tuple(to_device(t, self.device) for t in tensors)

    def ready(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self._stream is None:
            return tensors
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for t in tensors:
            t.record_stream(current)
        return tensors


def rng_states() -> dict[str, torch.Tensor]:
    """The generators a checkpoint keeps: the CPU's, and each visible GPU's as ``cuda{i}``."""
    states = {HOST: torch.get_rng_state()}
    if torch.cuda.is_available():
        states.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Puts back what :func:`rng_states` kept; GPUs this process does not see are skipped
    (a resume may see fewer GPUs per task than the save did)."""
    torch.set_rng_state(states[HOST])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda{i}" in states:
                torch.cuda.set_rng_state(states[f"cuda{i}"], i)


def pin_staging(device: torch.device | None) -> bool:
    """Whether a checkpoint save stages into pinned host memory: on a GPU, where the copy out
    of device memory then runs at full bandwidth; never on the CPU (nothing crosses a bus)."""
    return device is not None and copy_plan(device.type).pin and torch.cuda.is_available()
