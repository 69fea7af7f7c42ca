"""What a rank's memory holds: its tensors by construction, its peak, and its floor.

The floor is what a rank cannot do without: the bytes of the parameters, gradients and
optimizer state it holds (16 bytes per fp32 parameter under AdamW) plus the process's
runtime (Python, torch, the process groups) measured before the model exists. Everything a
rank's peak holds above its floor is activations, communication buffers and allocator slack:
the part a memory fix can change.

On CUDA the peak is the caching allocator's high-water mark of allocated bytes; on CPU it is
the process's resident set, sampled from ``/proc`` (the kernel resets the high-water mark on
request, so each phase has a peak of its own). The resident set is what the kernel's
out-of-memory killer sees, but it also holds what the host allocator keeps free for reuse,
which no memory model of tensors predicts; so with ``train.memory_phases`` a CPU rank also
samples the allocator's allocated bytes (:class:`AllocatedPeak`), the counterpart of CUDA's
allocated bytes.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from boostlr.platform import platform_for
from boostlr.train.host_alloc import allocated_bytes_reader
from boostlr.train.perf import peak_memory_mb

MB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once)."""
    total = 0
    for t in tensors:
        local = _local(t)
        if local.is_meta:
            continue
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def held_tensor_mb(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None
) -> dict[str, float]:
    """``mem_params_mb``, ``mem_grads_mb``, ``mem_optim_mb``: this rank's own tensors."""
    seen: set[int] = set()
    held = _storage_bytes(params, seen)
    grads = _storage_bytes((p.grad for p in params if p.grad is not None), seen)
    optim = 0
    if optimizer is not None:
        state = (v for s in optimizer.state.values() for v in s.values())
        # Scalar step counters are tensors too; they belong to the optimizer's bytes.
        optim = _storage_bytes((v for v in state if isinstance(v, torch.Tensor)), seen)
    return {"mem_params_mb": held / MB, "mem_grads_mb": grads / MB, "mem_optim_mb": optim / MB}


def current_rss_mb() -> float:
    """The process's resident set now (Linux ``/proc``; the high-water mark elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / MB
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """The process's high-water resident set since start, or since the last reset."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / MB if sys.platform == "darwin" else rss / 1024


def reset_peak_rss() -> bool:
    """Start a new high-water mark at the current resident set (Linux; ``False`` elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def device_now_mb(device: torch.device) -> float:
    """The device allocator's bytes in use; a CPU's resident set."""
    allocated = platform_for(device).allocated_bytes(device)
    return current_rss_mb() if allocated is None else allocated / MB


def device_peak_mb(device: torch.device) -> float:
    """The device allocator's high-water mark; a CPU's high-water resident set."""
    peak = platform_for(device).peak_allocated_bytes(device)
    return peak_rss_mb() if peak is None else peak / MB


class AllocatedPeak:
    """The high-water mark of the host allocator's allocated bytes, sampled by a thread.

    No allocator keeps that mark itself, so a daemon thread reads the count every
    ``interval_s`` (the read releases the GIL, and torch's ops run without it); a peak shorter
    than the interval can be missed, so the mark is a lower bound. Only for
    ``train.memory_phases`` runs: it costs a little CPU, never anything in the step's code.
    """

    def __init__(self, name: str, read: Callable[[], int], interval_s: float = 0.001):
        self.name, self._read, self._interval = name, read, interval_s
        self._lock = threading.Lock()
        self.runtime_mb = read() / MB
        self._peak = self.runtime_mb
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="boostlr-mem", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.now_mb()

    def now_mb(self) -> float:
        now = self._read() / MB
        with self._lock:
            self._peak = max(self._peak, now)
        return now

    def take_peak_mb(self) -> float:
        """The peak since the last call (a new phase starts from what is allocated now)."""
        now = self.now_mb()
        with self._lock:
            peak, self._peak = self._peak, now
        return peak

    def stop(self) -> None:
        """End the sampling thread (before the process exits, so it never outlives torch)."""
        self._stop.set()
        self._thread.join()


class MemoryPhases:
    """Per-phase memory of one rank: each phase's peak and what it leaves behind.

    ``mark(name)`` closes the phase that ended now; a phase marked again (every step's
    forward/backward) keeps its largest peak. With a ``path`` (``train.memory_phases``) the
    table is rewritten atomically at every mark, one file per rank, so a rank that dies
    leaves the phases it reached; without one only the start-up runtime is measured.
    """

    def __init__(self, device: torch.device, path: Path | None, allocator: str = ""):
        self.device, self.path, self.allocator = device, path, allocator
        self.rows: dict[str, dict[str, float]] = {}
        self.held: dict[str, float] = {}
        # Bytes each dp mode holds by construction beyond the shards, set once by the trainer
        # (:func:`boostlr.analysis.dp_choice.mode_held_bytes`): a fact of the layout.
        self.mode_held: dict[str, float] = {}
        self.runtime_mb = device_now_mb(device)
        reader = (
            allocated_bytes_reader() if path is not None and platform_for(device).is_host else None
        )
        self.allocated = AllocatedPeak(*reader) if reader is not None else None
        self.mark("start-up")

    def note_held(self, held: dict[str, float]) -> None:
        """Record the rank's own tensors (its floor less the runtime) with the phases."""
        self.held = held

    def mark(self, phase: str) -> None:
        if self.path is None:
            return
        peak = max(device_peak_mb(self.device), device_now_mb(self.device))
        row = self.rows.setdefault(phase, {"peak_mb": 0.0, "after_mb": 0.0})
        row["peak_mb"] = max(row["peak_mb"], peak)
        row["after_mb"] = device_now_mb(self.device)
        if self.allocated is not None:
            allocated = self.allocated.take_peak_mb()
            row["allocated_peak_mb"] = max(row.get("allocated_peak_mb", 0.0), allocated)
        tmp = self.path.with_suffix(".tmp")
        report = {
            "allocator": self.allocator,
            "runtime_mb": self.runtime_mb,
            **(
                {
                    "allocated_by": self.allocated.name,
                    "runtime_allocated_mb": self.allocated.runtime_mb,
                }
                if self.allocated is not None
                else {}
            ),
            "held": self.held,
            "phases": self.rows,
        }
        tmp.write_text(json.dumps(report))
        tmp.replace(self.path)
        # The next phase's peak starts from what this one left.
        if not platform_for(self.device).reset_peak_allocated(self.device):
            reset_peak_rss()

    def close(self) -> None:
        if self.allocated is not None:
            self.allocated.stop()

    def __enter__(self) -> MemoryPhases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peak_mb(self) -> float:
        """The largest peak of any phase so far (the per-phase resets hide it from the OS)."""
        marked = max((r["peak_mb"] for r in self.rows.values()), default=0.0)
        return max(marked, device_peak_mb(self.device))


def memory_row(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    phases: MemoryPhases,
) -> dict[str, float]:
    """A metrics row's memory: this rank's tensors, its peak and its floor (tensors plus the
    start-up runtime), in MiB; with ``phases.mode_held``, each dp mode's floor too,
    ``mem_floor_<mode>_mb``: the floor plus what that mode holds by construction (a ``ddp``
    rank's peak is held against ``mem_floor_ddp_mb``: its gathered stage is no growth)."""
    held = held_tensor_mb(params, optimizer)
    phases.note_held(held)
    peak = max(peak_memory_mb(device), phases.peak_mb)
    floor = sum(held.values()) + phases.runtime_mb
    per_mode = {f"mem_floor_{k}_mb": floor + v / MB for k, v in phases.mode_held.items()}
    return {**held, "peak_mem_mb": peak, "mem_floor_mb": floor, **per_mode}
