"""How long a rank may wait for another in a checkpoint's collectives: one rule for all.

Saving, loading and verifying a checkpoint each have every rank move its own bytes (write,
read or hash them) and then wait for the others on a gloo group. The slowest rank sets the
wait, so the group's timeout is ``parallel.timeout_s`` plus the time to move the largest
rank's bytes at :data:`MIN_IO_BYTES_PER_S`: a fixed timeout that suits a small checkpoint
would end the job during a 100+ GB one (the NCCL watchdog's default of 10 minutes covers
about 12 GB per rank at that rate).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from boostlr.platform import HOST_BACKEND

CKPT_GROUP = "checkpoint (gloo)"

# The slowest rate a rank is assumed to write, read or hash a checkpoint at (a busy network
# file system shared by a node's ranks).
MIN_IO_BYTES_PER_S = 20 * 2**20


def remade_group(old: dist.ProcessGroup | None, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of every rank that waits ``timeout_s``, replacing ``old`` (collective
    over every rank). A group's timeout is fixed when it is made, so it is made again;
    ``old`` is destroyed first: each gloo group holds a connection to every other rank, and
    at thousands of ranks two of them at once would double every rank's sockets."""
    if old is not None:
        dist.destroy_process_group(old)
    return dist.new_group(backend=HOST_BACKEND, timeout=timedelta(seconds=timeout_s))


class CheckpointGroup:
    """The one gloo group of every rank for checkpoint work, and the timeout it waits.

    All ranks on gloo, for checkpoint verification, saves and loads only: an async save's
    collectives then never interleave with training's (and work beside NCCL on GPUs), and
    the mesh's groups never wait as long as a checkpoint may take. The trainer makes one
    before any work; verification sizes it to the largest share to hash (:meth:`wait`),
    then :meth:`size_to` sizes it to the shards the saves and loads move, and the writer
    saves on it. ``group`` stays ``None`` in one process, where nothing waits.
    """

    def __init__(self, world: int):
        self.world = world
        self.group: dist.ProcessGroup | None = None
        self.timeout_s: float | None = None

    def wait(self, timeout_s: float) -> None:
        """Make the group wait ``timeout_s`` (collective over every rank when it changes)."""
        if self.world > 1 and timeout_s != self.timeout_s:
            self._remake(timeout_s)
        self.timeout_s = timeout_s

    def size_to(self, state: dict[str, Any], floor_s: float) -> None:
        """Size the group for saving and loading ``state``, this rank's shards: ``floor_s``
        plus the largest rank's bytes at the slowest rate (collective over every rank).

        Without a process group there is nothing to wait on and nothing changes. When
        verification left no group (a fresh run, or one rank) it is made at ``floor_s``
        first, to compare the ranks' bytes on.
        """
        if not dist.is_initialized():
            return
        if self.group is None:
            self._remake(floor_s)
        timeout_s = checkpoint_timeout_s(state, self.group, floor_s)
        if timeout_s != self.timeout_s:
            self._remake(timeout_s)

    def _remake(self, timeout_s: float) -> None:
        old, self.group = self.group, None
        self.group = remade_group(old, timeout_s)
        self.timeout_s = timeout_s

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.group = self.timeout_s = None


def io_timeout_s(floor_s: float, largest_bytes: int) -> float:
    """Seconds to wait: ``floor_s`` plus the largest rank's bytes at the slowest rate."""
    return floor_s + largest_bytes / MIN_IO_BYTES_PER_S


def largest_over_ranks(nbytes: int, group: dist.ProcessGroup | None) -> int:
    """The largest of every rank's ``nbytes`` (collective over ``group``; ``None``: mine)."""
    if group is None:
        return nbytes
    every: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, nbytes, group=group)
    return max(int(n) for n in every if n is not None)


def shard_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in ``state`` (a DTensor counts its local shard)."""
    if isinstance(state, dict):
        return sum(shard_bytes(v) for v in state.values())
    if torch.is_tensor(state):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def checkpoint_timeout_s(
    state: dict[str, Any], group: dist.ProcessGroup | None, floor_s: float
) -> float:
    """The checkpoint group's timeout for saving and loading ``state`` (this rank's shards;
    collective over ``group``)."""
    return io_timeout_s(floor_s, largest_over_ranks(shard_bytes(state), group))


class CollectiveTimeout(RuntimeError):
    """A collective on a named group ran past its timeout (reported as one line)."""


_TIMED_OUT = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")


@contextmanager
def collective_timeout(group: str, timeout_s: float) -> Iterator[None]:
    """Turn a timed-out collective on ``group`` into a :class:`CollectiveTimeout` whose
    message names the group and its timeout."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeout) or not any(s in str(exc) for s in _TIMED_OUT):
            raise
        raise CollectiveTimeout(
            f"the {group} group timed out after {timeout_s:g} s: another rank did not reach "
            "the same collective in time (it is slower, stuck or gone)"
        ) from None


def checkpoint_collectives(timeout_s: float | None) -> Any:
    """:func:`collective_timeout` for the checkpoint group (nothing when not sized)."""
    return nullcontext() if timeout_s is None else collective_timeout(CKPT_GROUP, timeout_s)
