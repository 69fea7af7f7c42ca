"""The checkpoint write stream: hashes in a second thread, syncs to disk as it writes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from boostlr.rundir import streams


def payload(n: int) -> bytes:
    return hashlib.shake_256(b"checkpoint").digest(n)


def test_large_and_small_writes_hash_in_order_and_sync_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams, "PARALLEL_HASH_BYTES", 1 << 10)
    monkeypatch.setattr(streams, "WRITE_PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(streams, "WRITEBACK_BYTES", 1 << 13)
    synced: list[int] = []

    def datasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        os.fsync(fd)

    monkeypatch.setattr(streams, "_datasync", datasync)
    chunks = [payload(100), payload(50_000), b"x" * 7, memoryview(payload(30_000))[5:]]
    path = tmp_path / "shard"
    with open(path, "wb") as raw:
        stream = streams.HashingStream(raw)
        for chunk in chunks:
            assert stream.write(chunk) == len(memoryview(chunk).cast("B"))
        stream.flush()
        stream.finish()
    data = b"".join(bytes(c) for c in chunks)
    assert path.read_bytes() == data and stream.tell() == stream.size == len(data)
    assert stream.hexdigest() == hashlib.sha256(data).hexdigest()
    assert synced and all(0 < size <= len(data) for size in synced)


def test_a_failed_background_sync_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams, "WRITE_PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(streams, "WRITEBACK_BYTES", 1 << 12)

    def datasync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(streams, "_datasync", datasync)
    with open(tmp_path / "shard", "wb") as raw:
        stream = streams.HashingStream(raw)
        with pytest.raises(OSError, match="Input/output error"):  # from the write or finish
            try:
                stream.write(payload(1 << 13))
            finally:
                stream.finish()
