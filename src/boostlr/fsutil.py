"""Durable file operations shared by datasets, checkpoints, exports and run directories.

Everything boostlr writes that a later step trusts is built aside, fsynced and renamed into
place, so a crash leaves either the old state or the new one, never a half-written file
that reads as valid.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make renames/creations in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_dir(new: Path, target: Path) -> None:
    """Rename directory ``new`` to ``target``; an existing ``target`` is deleted only after."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
        raise
    finally:
        fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
