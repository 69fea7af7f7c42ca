"""Every use of ``torch.distributed.checkpoint`` beyond its documented calls, in one module.

Four things boostlr needs that DCP does not offer as API:

* **Hashing while writing.** :class:`HashingFileSystemWriter` is DCP's ``FileSystemWriter``
  with its ``fs`` swapped for a :class:`HashingFileSystem`, whose write streams feed
  sha256 as the bytes go out (:mod:`.streams`, which also overlaps the hash and the
  disk's write-back with the writing); a save then never reads its shards back. This
  relies on DCP writing every file (shards and ``.metadata``) through ``self.fs`` in
  sequence, and renaming ``.metadata.tmp`` through ``fs.rename``.
* **No zip CRC in the shards** (``write_data``): DCP writes every tensor with ``torch.save``,
  whose CRC-32 costs about as much CPU as copying the bytes, and nothing checks it (not
  ``torch.load``); every file's sha256 in ``meta.json`` already covers it. The records carry
  a CRC of 0. The switch is process-wide while a save writes (one save at a time): a
  ``torch.save`` elsewhere in the process in that window also skips its CRC.
* **Staging before the save.** The trainer copies the state to host memory itself
  (:func:`make_stager`: pinned on CUDA) and hands DCP the copy, so the ranks' per-save
  numbers can be exchanged while the checkpoint group is idle.
* **Safe metadata.** :class:`SafeFileSystemReader` unpickles ``.metadata`` through an
  allowlist of DCP's own classes (it names the private ``_StorageInfo``).

``tests/test_dcp_io.py`` fails if a torch release changes any of this.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from boostlr._torch_internals import torch_save_without_crc
from boostlr.faults import SLOW_IO_ENV, throttle_io
from boostlr.platform import bind_thread_device
from boostlr.rundir.streams import HashingStream


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns on every one-process save/load that it "assumes" one process: we ask for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------- writing


class HashingFileSystem(FileSystem):
    """DCP's local file system; every file written through it has its size and sha256 kept
    in :attr:`digests` (by file name), following renames."""

    def __init__(self) -> None:
        self.digests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[io.IOBase]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            try:
                yield stream
                stream.flush()
            finally:
                stream.finish()  # before the file closes: its background sync uses the fd
        with self._lock:
            self.digests[Path(path).name] = {"size": stream.size, "sha256": stream.hexdigest()}

    def rename(self, path: str | Path, new_path: str | Path) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.digests.pop(Path(path).name, None)
            if entry is not None:
                self.digests[Path(new_path).name] = entry

    def rm_file(self, path: str | Path) -> None:
        super().rm_file(path)
        with self._lock:
            self.digests.pop(Path(path).name, None)


class HashingFileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer (fsync on, one file per rank) that hashes what it writes.

    Its ``stage`` passes the state through: the caller stages it (:func:`stage_state`)
    before :func:`dcp.async_save`, which would otherwise copy it a second time. It turns
    DCP's copy-ahead off there, as torch's own ``stage`` does: the state is already in host
    memory, and copying ahead calls ``torch.cuda.current_stream()`` and ``synchronize()``
    from DCP's writer thread. That thread makes ``device`` (the rank's) current before
    anything else, so no CUDA call of it lands on another GPU.
    """

    def __init__(self, path: str | Path, device: torch.device | None = None):
        super().__init__(str(path), sync_files=True)
        self.fs = HashingFileSystem()
        self.device = device

    @property
    def digests(self) -> dict[str, dict[str, Any]]:
        return dict(self.fs.digests)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.per_thread_copy_ahead = 0
        return state_dict

    def storage_meta(self) -> StorageMeta | None:
        # DCP's first call on the writer, in the thread that saves.
        bind_thread_device(self.device)
        return super().storage_meta()

    def write_data(self, plan: Any, planner: Any) -> Any:
        # Runs where the bytes are written (DCP's background thread for an async save).
        bind_thread_device(self.device)
        with torch_save_without_crc():  # the module docstring says why
            return super().write_data(plan, planner)


def make_stager(pin: bool) -> DefaultStager:
    """A stager that copies a state into host memory, blocking until the copy is done.

    Pinned (with non-blocking device copies) when ``pin``; kept by the caller across saves
    then, since pinning host memory is slow and the buffers are reused every save.
    """
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pin,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=pin,
        )
    )


def stage_state(stager: DefaultStager, state: dict[str, Any]) -> dict[str, Any]:
    """A host copy of ``state`` (DTensors stay DTensors, with host local shards)."""
    staged = stager.stage(state)
    assert isinstance(staged, dict)  # synchronous staging returns the copy itself
    return staged


def save(
    state: dict[str, Any],
    writer: HashingFileSystemWriter,
    group: torch.distributed.ProcessGroup | None,
) -> None:
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)


def async_save(
    staged: dict[str, Any],
    writer: HashingFileSystemWriter,
    group: torch.distributed.ProcessGroup | None,
) -> Any:
    """Write an already staged state in DCP's background thread; returns its future."""
    with quiet_dcp():
        return dcp.async_save(
            staged,
            storage_writer=writer,
            async_stager=writer,
            process_group=group,
            no_dist=group is None,
        )


# ---------------------------------------------------------------------------- reading


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: only its own classes may load.

    DCP reads ``.metadata`` with a bare ``pickle.load`` (the shards it reads with
    ``weights_only``); a crafted file could run any code. This allowlist is what the
    metadata of a boostlr checkpoint holds.
    """

    ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or name in self.ALLOWED.get(module, ())
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allowlist (and the reads
    slowed by ``BOOSTLR_SLOW_IO`` in tests, by the bytes ``storage_data`` lists)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        done = super().read_data(plan, planner)
        if os.environ.get(SLOW_IO_ENV):
            throttle_io(sum(self.storage_data[i.storage_index].length for i in plan.items))
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(state: dict[str, Any], path: Path, group: torch.distributed.ProcessGroup | None) -> None:
    """Load ``path`` in place into ``state`` (DCP reshards to the state's layout)."""
    with quiet_dcp():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(path)),
            process_group=group,
            no_dist=group is None,
        )
