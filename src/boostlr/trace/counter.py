"""Live tensor bytes of one process, counted per storage, and their peak per phase.

One counter for fake and real tensors alike, so a traced rank and a real gloo rank are
measured the same way. Every operator's outputs (and its in-place arguments) are looked at
as it runs: each storage not on the device ``meta`` is counted once, with its current size,
until it is freed (a weak reference on the storage). A storage that is resized in place
(FSDP frees and re-allocates its gathered parameters so, and so does the gloo-only
in-place path) is re-counted at once: ``UntypedStorage.resize_`` is wrapped while counting.

A tensor subclass (DTensor) is let through (the mode answers ``NotImplemented``), so the
subclass's own operators on its local tensors, temporaries included, are the ones counted.
Fake tensors of another mode than the trace's, and those of DTensor's shape propagation,
hold no memory and are skipped. Memory an operator allocates and frees inside itself (a
kernel's workspace, a gloo buffer) is not seen, by either kind of run.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from boostlr.trace.fake_world import (
    TorchDispatchMode,
    fake_mode_of,
    in_backward,
    is_traceable_wrapper_subclass,
    mutates,
    shape_propagation_paused,
    storage_key,
)

# torch's c10/cuda/CUDACachingAllocator.cpp: every block is a multiple of kMinBlockSize
# (round_size); a request of kMinLargeAlloc or more gets a segment of its own, rounded up to
# kRoundLarge (get_allocation_size), whose tail is split off for reuse only when it is over
# kSmallSize (the split rule for large blocks), else it stays with the block.
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def allocator_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator holds for a request of ``nbytes`` (0 for 0)."""
    if nbytes <= 0:
        return 0
    block = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    if nbytes >= MIN_LARGE_ALLOC:
        segment = -(-nbytes // ROUND_LARGE) * ROUND_LARGE
        if segment - block <= SMALL_SIZE:
            return segment
    return block


def tensors_in(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of an operator's arguments or outputs (nested lists, tuples, dicts).

    What ``torch.utils._pytree.tree_leaves`` would find among them, without its generic
    node registry: called twice per operator, pytree's cost was a tenth of a trace.
    """
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensors_in(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors_in(item, out)
    return out


class StorageCounter(TorchDispatchMode):
    """Counts live storages while active; :meth:`phase` starts a new peak."""

    def __init__(self, fake_mode: Any = None) -> None:
        """``fake_mode``: the trace's fake mode, whose tensors count; fake tensors of any
        other mode (DTensor's sharding propagation makes some) are shape arithmetic."""
        super().__init__()
        self.fake_mode = fake_mode
        self.paused = 0  # > 0: DTensor's shape propagation (no memory) is running
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.rounded = 0  # the same storages as the CUDA caching allocator rounds them
        self.phase_name = "start"
        # Ops inside the autograd engine count towards this phase instead (if set).
        self.backward_phase: str | None = None
        self.peaks: dict[str, int] = {}
        self.peak_rounded = 0

    # ------------------------------------------------------------------ bookkeeping

    def phase(self, name: str) -> None:
        """From now on the peak is ``name``'s; it starts at what is live now."""
        self.phase_name = name
        self.peaks[name] = self.current

    def _bump(self) -> None:
        name = self.phase_name
        if self.backward_phase is not None and in_backward():
            name = self.backward_phase
        if self.current > self.peaks.get(name, 0):
            self.peaks[name] = self.current
        if self.current >= max(self.peaks.values()):
            self.peak_rounded = self.rounded

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]
            self.rounded -= allocator_size(entry[1])

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once), or re-read its size if already counted."""
        if is_traceable_wrapper_subclass(tensor):
            inner, _ = tensor.__tensor_flatten__()
            for attr in inner:
                self.track(getattr(tensor, attr))
            return
        if tensor.is_meta or fake_mode_of(tensor) not in (None, self.fake_mode):
            return
        storage = tensor.untyped_storage()
        self._account(storage)

    def _account(self, storage: torch.UntypedStorage) -> None:
        key = storage_key(storage)
        size = storage.nbytes()
        entry = self.live.get(key)
        if entry is not None:
            self.current += size - entry[1]
            self.rounded += allocator_size(size) - allocator_size(entry[1])
            self.live[key] = (entry[0], size)
        else:
            ref = weakref.ref(storage, lambda _r, k=key: self._freed(k))
            self.live[key] = (ref, size)
            self.current += size
            self.rounded += allocator_size(size)
        self._bump()

    def peak(self) -> int:
        return max(self.peaks.values(), default=self.current)

    # ------------------------------------------------------------------ the mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        leaves = tensors_in(kwargs, tensors_in(args, []))
        if any(is_traceable_wrapper_subclass(t) for t in leaves):
            return NotImplemented
        out = func(*args, **kwargs)
        for t in tensors_in(out, []):
            self.track(t)
        if mutates(func):  # resize_, set_, out= ops: their arguments may change
            for t in leaves:
                self.track(t)
        return out


@contextmanager
def counting(counter: StorageCounter) -> Iterator[StorageCounter]:
    """``counter`` active, with in-place storage resizes re-counted."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        result = original(storage, size)
        key = storage_key(storage)
        if key in counter.live:
            counter._account(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        with shape_propagation_paused(counter), counter:
            yield counter
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
