"""Tokenise a corpus once into memory-mappable token shards plus a manifest.

Layout of a prepared dataset directory::

    manifest.json       what is here, with token counts and sha256 of every shard
    tokenizer.json      the tokenizer used (so training/generation can decode)
    train_00000.bin     raw little-endian uint16 (uint32 for vocabularies > 65535)
    val_00000.bin

The directory is built under a temporary name next to ``out_dir`` and renamed into place only
when complete, so a crash never leaves a half-written dataset that looks valid; Ctrl-C and
SIGTERM remove the temporary directory (a rerun starts afresh). Encoding is a pipeline
(:mod:`boostlr.data.encode`) whose memory is a few batches, whatever the corpus size.
Each phase (scan, tokenizer, merges, encode) records its wall time and cores used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

from boostlr.data.corpus import (
    default_corpus_documents,
    default_corpus_files,
    discover_files,
    iter_documents,
)
from boostlr.data.encode import encode_stream
from boostlr.data.progress import Meter, phase
from boostlr.data.tokenizer import eos_id, load_tokenizer, parse_bpe_spec, train_bpe
from boostlr.errors import DataError
from boostlr.fsutil import fsync_dir, fsync_file, replace_dir, sha256_file

FORMAT = "boostlr-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")


def prepare_dataset(
    inputs: Sequence[str | Path] | None,
    out_dir: str | Path,
    tokenizer: str = "bpe:4096",
    val_fraction: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
    overwrite: bool = False,
    phases: list[Meter] | None = None,
) -> dict[str, Any]:
    """Tokenise ``inputs`` (None: built-in stdlib corpus) into ``out_dir``; return the manifest.

    ``phases``, if given, receives one timed :class:`Meter` per phase as it ends.
    """
    out = Path(out_dir).expanduser().absolute()
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction} must be in [0, 1); e.g. 0.01")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens} must be positive; e.g. 50000000")
    _check_out_dir(out, overwrite)
    documents, source = _document_source(inputs)
    with _terminate_as_interrupt():
        return _prepare(
            documents,
            source,
            out,
            tokenizer,
            val_fraction,
            seed,
            shard_tokens,
            progress,
            [] if phases is None else phases,
        )


def _prepare(
    documents: Callable[[], Iterator[str]],
    source: dict[str, Any],
    out: Path,
    tokenizer: str,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
    progress: bool,
    phases: list[Meter],
) -> dict[str, Any]:
    with phase(progress, "scan", None, phases) as meter:
        n_docs, n_text = _count_documents(documents(), meter)
    if n_text == 0:  # whitespace alone would still tokenise into a dataset of a few tokens
        raise DataError(
            f"{source['description']} contains no text ({n_docs} documents, all empty or "
            "whitespace): pass files with text to --input"
        )
    val_docs = _val_indices(n_docs, val_fraction, seed)

    tok = _tokenizer(tokenizer, documents, progress, n_docs, phases)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")
    eos = eos_id(tok)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok.save(str(tmp / TOKENIZER_FILE))
        fsync_file(tmp / TOKENIZER_FILE)
        writers = {split: _ShardWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
        with phase(progress, "encode", n_docs, phases) as meter:
            for index, ids in encode_stream(tok, documents(), eos, dtype, meter):
                writers["val" if index in val_docs else "train"].write(ids)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": tokenizer,
            "tokenizer_file": TOKENIZER_FILE,
            "vocab_size": vocab_size,
            "eos_id": eos,
            "dtype": dtype.name,
            "seed": seed,
            "val_fraction": val_fraction,
            "source": source,
            "documents": {"train": n_docs - len(val_docs), "val": len(val_docs), "total": n_docs},
            "splits": {split: w.close() for split, w in writers.items()},
        }
        _write_json(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _count_documents(documents: Iterable[str], meter: Meter) -> tuple[int, int]:
    """``(documents, documents with non-whitespace text)``."""
    n_docs = n_text = 0
    for doc in documents:
        n_docs += 1
        n_text += bool(doc) and not doc.isspace()
        meter.advance(1, len(doc.encode("utf-8")))
    return n_docs, n_text


def _tokenizer(
    spec: str,
    documents: Callable[[], Iterator[str]],
    progress: bool,
    n_docs: int,
    phases: list[Meter],
) -> Tokenizer:
    """Load ``spec``, or train it as two phases: "tokenizer" and "merges".

    "tokenizer" lasts while the trainer reads the documents (it pre-tokenises and counts
    them on its own threads meanwhile); "merges" starts when they run out and ends with the
    training, so the BPE merge loop has a bar and a time of its own. The trainer takes
    documents 256 at a time, so "merges" also holds the pre-tokenising of the last few.
    """
    vocab = parse_bpe_spec(spec)
    if vocab is None:
        return load_tokenizer(spec)
    with contextlib.ExitStack() as merges:

        def fed() -> Iterator[str]:
            with phase(progress, "tokenizer", n_docs, phases) as meter:
                for doc in documents():
                    meter.advance(1, len(doc.encode("utf-8")))
                    yield doc
            merges.enter_context(phase(progress, "merges", None, phases))

        return train_bpe(fed(), vocab)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` (as Ctrl-C does), so the temp dir is removed.

    Only the main thread can set a handler; elsewhere the default behaviour stays.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to clobber data; ``overwrite`` only ever replaces a (possibly broken) dataset."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output {out} is a file; choose a directory path for --out")
    if not any(out.iterdir()):
        return
    if not (out / MANIFEST).is_file():
        raise DataError(
            f"output directory {out} is not empty and is not a prepared dataset; "
            "choose a new or empty directory for --out"
        )
    if not overwrite:
        raise DataError(
            f"output directory {out} already holds a prepared dataset; "
            "pass --overwrite to rebuild it or choose another --out"
        )


def _document_source(
    inputs: Sequence[str | Path] | None,
) -> tuple[Callable[[], Iterator[str]], dict[str, Any]]:
    """A re-iterable document stream (read once to count, once to train BPE, once to encode)."""
    if inputs is None:
        files = default_corpus_files()
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        source = {
            "kind": "default",
            "description": f"Python {version} standard library sources + pydoc topics",
            "files": len(files),
        }
        return default_corpus_documents, source
    files = discover_files(inputs)
    source = {
        "kind": "files",
        "description": ", ".join(str(p) for p in inputs),
        "files": len(files),
    }
    return lambda: iter_documents(files), source


def _val_indices(n_docs: int, val_fraction: float, seed: int) -> frozenset[int]:
    """Seeded choice of validation documents; at least one when possible, never all."""
    if val_fraction == 0.0 or n_docs < 2:
        return frozenset()
    n_val = min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    order = np.random.default_rng(seed).permutation(n_docs)
    return frozenset(order[:n_val].tolist())


class _ShardWriter:
    """Appends tokens of one split to ``<split>_NNNNN.bin`` files of at most ``shard_tokens``."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._fh: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._fh is None:
                self._open()
            room = self.shard_tokens - self._count
            part, ids = ids[:room], ids[room:]
            data = part.tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self._count += len(part)
            if self._count == self.shard_tokens:
                self._finish_shard()

    def close(self) -> dict[str, Any]:
        """Flush the last shard and return this split's manifest entry."""
        if self._fh is not None:
            self._finish_shard()
        return {"tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._fh = open(self.directory / name, "wb")  # closed in _finish_shard
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})
        self._hash = hashlib.sha256()
        self._count = 0

    def _finish_shard(self) -> None:
        assert self._fh is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read ``manifest.json`` of the dataset directory ``path``."""
    directory = Path(path).expanduser()
    file = directory / MANIFEST
    if not file.is_file():
        raise DataError(
            f"no prepared dataset at {directory} (manifest.json missing); "
            f"run `boostlr prepare --input ... --out {directory}` first"
        )
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(
            f"cannot read {file}: {exc}; re-run `boostlr prepare` with --overwrite"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{file} is not a boostlr dataset manifest; re-run `boostlr prepare`")
    if manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{file} has format version {manifest.get('version')}, expected {FORMAT_VERSION}; "
            "re-run `boostlr prepare` with --overwrite"
        )
    return manifest


def validate_dataset(path: str | Path, check_checksums: bool = False) -> dict[str, Any]:
    """Check every file the manifest names exists with the right size (and hash); return it."""
    directory = Path(path).expanduser()
    manifest = load_manifest(directory)
    rebuild = "re-run `boostlr prepare` with --overwrite"
    try:
        _validate_files(directory, manifest, check_checksums, rebuild)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{directory / MANIFEST} is malformed ({exc!r}); {rebuild}") from exc
    return manifest


def _validate_files(
    directory: Path, manifest: dict[str, Any], check_checksums: bool, rebuild: str
) -> None:
    if not (directory / manifest["tokenizer_file"]).is_file():
        raise DataError(f"{directory / manifest['tokenizer_file']} is missing; {rebuild}")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        entry = manifest["splits"][split]
        if sum(s["tokens"] for s in entry["shards"]) != entry["tokens"]:
            raise DataError(f"{directory}: {split} shard token counts do not add up; {rebuild}")
        for shard in entry["shards"]:
            _validate_shard(directory / shard["file"], shard, itemsize, check_checksums, rebuild)


def _validate_shard(
    file: Path, shard: dict[str, Any], itemsize: int, check_checksums: bool, rebuild: str
) -> None:
    if not file.is_file():
        raise DataError(f"shard {file} is missing; {rebuild}")
    expected = shard["tokens"] * itemsize
    if file.stat().st_size != expected:
        raise DataError(
            f"shard {file} has {file.stat().st_size} bytes, expected {expected}; {rebuild}"
        )
    if check_checksums and sha256_file(file) != shard["sha256"]:
        raise DataError(f"shard {file} fails its sha256 checksum (corrupt); {rebuild}")


def default_cache_dir() -> Path:
    """``$BOOSTLR_CACHE`` or ``~/.cache/boostlr``."""
    return Path(os.environ.get("BOOSTLR_CACHE") or Path.home() / ".cache" / "boostlr").expanduser()


def default_dataset_dir(cache_dir: Path | None = None, vocab_size: int = 4096) -> Path:
    """Where :func:`default_dataset` keeps the stdlib corpus of this Python and vocab."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    return cache / f"stdlib-py{version}-bpe{vocab_size}"


def default_dataset_ready(cache_dir: Path | None = None, vocab_size: int = 4096) -> Path | None:
    """The prepared default corpus of that vocab, or None (nothing is prepared here)."""
    out = default_dataset_dir(cache_dir, vocab_size)
    return out if _is_valid(out) else None


def default_dataset(
    cache_dir: Path | None = None, vocab_size: int = 4096, progress: bool = True
) -> Path:
    """Prepare the built-in stdlib corpus once per Python version and vocab; reuse it after."""
    out = default_dataset_dir(cache_dir, vocab_size)
    cache = out.parent
    cache.mkdir(parents=True, exist_ok=True)
    # Several data-parallel ranks may call this at once: only one prepares, the rest reuse.
    with _file_lock(cache / f".{out.name}.lock"):
        if not _is_valid(out):
            prepare_dataset(None, out, f"bpe:{vocab_size}", progress=progress, overwrite=True)
    return out


def _is_valid(path: Path) -> bool:
    try:
        validate_dataset(path)
    except DataError:
        return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
