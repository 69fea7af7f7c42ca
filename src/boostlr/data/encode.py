"""Parallel, bounded-memory encoding of a document stream for ``boostlr prepare``.

Three stages overlap: a reader thread pulls documents (file reading, JSON or Arrow parsing)
into batches of about ``batch_chars`` characters, an encoder thread runs
``Tokenizer.encode_batch_fast`` on one batch (Rust, all cores, the GIL released) while the
caller's thread turns the previous batch into token arrays and writes them. At most a few
batches are alive at once, so memory depends on the batch size, not on the corpus. The
reader's and the caller's CPU time go into the meter as stages ``read`` and ``write``; the
rest of the phase's CPU time is the tokenizer's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from boostlr.data.progress import Meter

BATCH_CHARS = 4_000_000  # text handed to one encode call
_QUEUE_BATCHES = 2  # read-ahead of the reader thread
_DONE = object()


def encode_stream(
    tok: Tokenizer,
    documents: Iterable[str],
    eos: int,
    dtype: np.dtype,
    meter: Meter,
    batch_chars: int | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(document index, token ids + EOS)`` in document order.

    A literal ``<|endoftext|>`` inside a document is encoded as text, never as a false
    document boundary. ``meter`` counts documents, their UTF-8 bytes and the tokens yielded.
    ``batch_chars`` defaults to :data:`BATCH_CHARS`.
    """
    batch_chars = batch_chars or BATCH_CHARS
    batches: queue.Queue = queue.Queue(maxsize=_QUEUE_BATCHES)
    stop = threading.Event()
    read_cpu: list[float] = []
    reader = threading.Thread(
        target=_read, args=(documents, batch_chars, batches, stop, read_cpu), daemon=True
    )
    write_cpu = time.thread_time()
    reader.start()
    saved = tok.encode_special_tokens
    tok.encode_special_tokens = True
    index = 0
    try:
        with ThreadPoolExecutor(max_workers=1) as encoder:
            pending: Future | None = None
            while True:
                batch = _next(batches)
                job = None if batch is None else encoder.submit(_encode, tok, batch)
                if pending is not None:
                    docs, encodings = pending.result()
                    for doc, encoding in zip(docs, encodings, strict=True):
                        ids = np.empty(len(encoding.ids) + 1, dtype=dtype)
                        ids[:-1] = encoding.ids
                        ids[-1] = eos
                        meter.advance(1, len(doc.encode("utf-8")), len(ids))
                        yield index, ids
                        index += 1
                if job is None:
                    break
                pending = job
    finally:
        stop.set()
        _drain(batches)
        reader.join()
        tok.encode_special_tokens = saved
        meter.stage_cpu_s["read"] = sum(read_cpu)
        meter.stage_cpu_s["write"] = time.thread_time() - write_cpu


def _encode(tok: Tokenizer, batch: list[str]) -> tuple[list[str], list[Any]]:
    return batch, tok.encode_batch_fast(batch, add_special_tokens=False)


def _read(
    documents: Iterable[str],
    batch_chars: int,
    out: queue.Queue,
    stop: threading.Event,
    cpu: list[float],
) -> None:
    """Reader thread: batches into ``out``; an exception is handed over as the item.

    Its CPU seconds are appended to ``cpu`` when it ends.
    """
    start = time.thread_time()
    try:
        batch: list[str] = []
        size = 0
        for doc in documents:
            batch.append(doc)
            size += len(doc)
            if size >= batch_chars:
                if not _put(out, batch, stop):
                    return
                batch, size = [], 0
        if batch and not _put(out, batch, stop):
            return
        _put(out, _DONE, stop)
    except BaseException as exc:  # re-raised in the caller's thread
        _put(out, exc, stop)
    finally:
        cpu.append(time.thread_time() - start)


def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _next(batches: queue.Queue) -> list[str] | None:
    item = batches.get()
    if item is _DONE:
        return None
    if isinstance(item, BaseException):
        raise item
    return item


def _drain(batches: queue.Queue) -> None:
    while True:
        try:
            batches.get_nowait()
        except queue.Empty:
            return
