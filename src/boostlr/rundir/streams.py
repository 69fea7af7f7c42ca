"""A write stream that hashes its bytes and has the disk write them back while it goes on.

A save should block about as long as writing the same bytes and fsyncing them. Done one
after the other, a checkpoint file costs its serialization, its sha256 and then, at the
fsync, the whole disk write: the kernel starts writing dirty pages back on its own only
past a share of RAM, far more than one rank's shard. So :class:`HashingStream` overlaps:

* sha256 of a large write runs in a second thread while the bytes are written (hashlib and
  file writes release the GIL); the write returns when both are done, so the caller's
  buffer is never read after it is handed back, and the hash sees the bytes in order;
* every :data:`WRITEBACK_BYTES` written, a third thread ``fdatasync``\\ s the file, so the
  disk writes while serialization and hashing go on, and the final fsync waits only for
  the tail. An error of that background sync fails the save (a later fsync may not report
  it again).
"""

from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from boostlr.faults import throttle_io

# Writes at least this large are hashed in the second thread; smaller ones inline: on a
# machine with fewer free cores than threads, waking the hashing thread for every
# megabyte-sized tensor cost more than the overlap saved.
PARALLEL_HASH_BYTES = 8 << 20
# A large write reaches the file in pieces of this size, so the background sync can start
# within one large tensor.
WRITE_PIECE_BYTES = 8 << 20
# Bytes written between two background syncs (one at a time).
WRITEBACK_BYTES = 32 << 20

_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


class HashingStream(io.IOBase):
    """A write-only, forward-only file stream that hashes every byte it writes.

    ``seek`` is refused: a writer that went back would make the running hash wrong, so a
    torch that starts seeking fails the save (and the test) instead of writing bad hashes.
    Call :meth:`finish` before the underlying file is closed (it joins the threads).
    """

    def __init__(self, raw: io.IOBase):
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0
        self._unsynced = 0
        self._syncing: Future | None = None
        self._hasher: ThreadPoolExecutor | None = None
        self._syncer: ThreadPoolExecutor | None = None
        try:
            self._fd: int | None = raw.fileno()
        except (OSError, AttributeError, io.UnsupportedOperation):
            self._fd = None  # an in-memory stream: nothing to sync

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < PARALLEL_HASH_BYTES:
            self._write_all(view)
            self._sha.update(view)
        else:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
            hashing = self._hasher.submit(self._sha.update, view)
            try:
                self._write_all(view)
            finally:
                hashing.result()
        self.size += len(view)
        throttle_io(len(view))
        return len(view)

    def _write_all(self, view: memoryview) -> None:
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            piece = view[start : start + WRITE_PIECE_BYTES]
            while piece:
                written = self._raw.write(piece)
                written = len(piece) if written is None else written
                piece = piece[written:]
                self._unsynced += written
            self._maybe_sync()

    def _maybe_sync(self) -> None:
        """Start a background sync of what is written so far, if none is running."""
        if self._fd is None or self._unsynced < WRITEBACK_BYTES:
            return
        if self._syncing is not None:
            if not self._syncing.done():
                return
            self._syncing.result()  # re-raise its error
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sync")
        self._raw.flush()
        self._syncing = self._syncer.submit(_datasync, self._fd)
        self._unsynced = 0

    def finish(self) -> None:
        """Wait for the background sync (re-raising its error) and stop the threads."""
        try:
            if self._syncing is not None:
                self._syncing.result()
        finally:
            self._syncing = None
            for pool in (self._hasher, self._syncer):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._hasher = self._syncer = None

    def tell(self) -> int:
        return self.size

    def seek(self, *args: Any) -> int:
        raise io.UnsupportedOperation("a hashing checkpoint stream only writes forward")

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:  # the file is closed by the stream's context manager
        if not self.closed:
            self._raw.flush()
        super().close()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()
