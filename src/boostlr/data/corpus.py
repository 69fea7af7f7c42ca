"""Finding and reading raw text documents.

Inputs are plain files (.txt/.md/.py, one document each; a file over 256 KiB is read as
several, see :func:`iter_text_pieces`), JSON Lines (one document per line, in the ``text``
field), Parquet (the ``text`` column) or Arrow (the ``text`` column: the ``data-*.arrow``
files of a Hugging Face ``datasets`` directory written by ``save_to_disk``, so such a
directory, or a ``DatasetDict`` one, is an input as it is). The default corpus is the
running Python's own standard library plus the pydoc topics, so a first run needs no download.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from boostlr.errors import DataError

TEXT_SUFFIXES = frozenset({".txt", ".md", ".py"})
SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet", ".arrow"}

# Stdlib directories left out of the default corpus: tests, GUI/demo code, vendored or
# installed packages and generated tables (codec maps, the pydoc topics dump, which is added
# separately as prose).
_STDLIB_EXCLUDE = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "site-packages",
        "dist-packages",
        "lib2to3",
        "__pycache__",
        "ensurepip",
        "tkinter",
        "turtledemo",
        "encodings",
        "pydoc_data",
        "lib-dynload",
    }
)
_STDLIB_MAX_FILE_BYTES = 400_000
# Plain-text files larger than this are read as several documents of at most this size, so
# memory stays bounded by it, whatever the file size, and a single big file still has
# documents for a validation split; an EOS token every 256 KiB of text is rare next to any
# training sequence length.
TEXT_PIECE_BYTES = 256 * 1024


def discover_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand files and directories (recursively) into a sorted list of usable input files.

    Sorting makes the document order, and therefore the train/val split, reproducible.
    """
    if not paths:
        raise DataError("no input paths given; pass at least one file or directory with --input")
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(f"input path {path} does not exist; check the --input argument")
        if path.is_dir():
            found.update(_walk_dir(path))
        elif path.suffix.lower() in SUFFIXES:
            found.add(path.resolve())
        else:
            raise DataError(
                f"input file {path} has unsupported type {path.suffix!r}; "
                f"use one of {', '.join(sorted(SUFFIXES))}"
            )
    if not found:
        raise DataError(
            f"no usable files ({', '.join(sorted(SUFFIXES))}) found under "
            f"{', '.join(str(p) for p in paths)}; point --input at your text data"
        )
    return sorted(found)


def _walk_dir(root: Path) -> Iterator[Path]:
    """Usable files under ``root``, skipping hidden files and directories (.git, .venv, ...)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.suffix.lower() in SUFFIXES:
                yield path.resolve()


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """Yield every non-empty document of ``files`` in order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            docs: Iterable[str] = _iter_jsonl(path)
        elif suffix == ".parquet":
            docs = _iter_parquet(path)
        elif suffix == ".arrow":
            docs = _iter_arrow(path)
        else:
            docs = iter_text_pieces(path)
        yield from (doc for doc in docs if doc)


def iter_text_pieces(path: Path, piece_bytes: int = TEXT_PIECE_BYTES) -> Iterator[str]:
    """A plain-text file as documents of at most ``piece_bytes`` bytes, read piece by piece.

    A file no larger than ``piece_bytes`` is one document. A larger one is cut after the last
    blank line in each piece's final quarter, else after its last line break in the second
    half, else at a character boundary, so documents (and the EOS between them) fall between
    paragraphs where the text has them. The pieces concatenate to the file's text. Invalid
    UTF-8 is replaced rather than fatal.
    """
    try:
        with path.open("rb") as fh:
            buf = b""
            while block := fh.read(piece_bytes):
                buf += block
                while len(buf) > piece_bytes:  # more follows this piece: cut it
                    cut = _cut(buf, piece_bytes)
                    yield buf[:cut].decode("utf-8", errors="replace")
                    buf = buf[cut:]
            if buf:
                yield buf.decode("utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}; check the file permissions") from exc


def _cut(buf: bytes, limit: int) -> int:
    """End of the next piece of ``buf`` (at most ``limit``): a blank line, a line break, or a
    character boundary."""
    blank = buf.rfind(b"\n\n", limit * 3 // 4, limit)
    if blank >= 0:
        return blank + 2
    newline = buf.rfind(b"\n", limit // 2, limit)
    if newline >= 0:
        return newline + 1
    cut = limit
    while cut > limit - 3 and buf[cut] & 0xC0 == 0x80:  # inside a UTF-8 character
        cut -= 1
    return cut


def _iter_jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg}); fix or remove that line"
                ) from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f'{path}:{lineno}: record has no string "text" field; '
                    'every JSONL line must be an object like {"text": "..."}'
                )
            yield text


def _require_pyarrow(path: Path) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise DataError(
            f"reading {path} needs pyarrow; run `pip install pyarrow` (or boostlr[parquet])"
        ) from exc


def _iter_parquet(path: Path) -> Iterator[str]:
    _require_pyarrow(path)
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise DataError(
                f"{path} has no 'text' column (columns: {', '.join(parquet.schema_arrow.names)}); "
                "store the documents in a string column named 'text'"
            )
        for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises many unrelated types for corrupt files
        raise DataError(f"cannot read parquet file {path}: {exc}; check the file") from exc


def _iter_arrow(path: Path) -> Iterator[str]:
    """An Arrow IPC stream (what ``datasets`` writes) or file, one record batch at a time."""
    _require_pyarrow(path)
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
            names = reader.schema.names
            if "text" not in names:
                raise DataError(
                    f"{path} has no 'text' column (columns: {', '.join(names)}); store the "
                    "documents in a string column named 'text'"
                )
            column = names.index("text")
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            for batch in batches:
                yield from (t for t in batch.column(column).to_pylist() if isinstance(t, str))
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises many unrelated types for corrupt files
        raise DataError(f"cannot read Arrow file {path}: {exc}; check the file") from exc


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> list[Path]:
    """The running Python's standard-library ``.py`` sources (about 8 MB), sorted."""
    root = _stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDE and not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if name.endswith(".py") and path.stat().st_size <= _STDLIB_MAX_FILE_BYTES:
                files.append(path)
    if not files:
        raise DataError(
            f"no Python standard library sources found in {root}; "
            "pass your own text with --input instead"
        )
    return sorted(files)


def default_corpus_documents() -> Iterator[str]:
    """Stdlib sources followed by the Python documentation topics (English prose)."""
    yield from iter_documents(default_corpus_files())
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    yield from (topics[key] for key in sorted(topics) if topics[key])
