"""What boostlr relies on in ``torch.distributed.checkpoint`` beyond its API (``rundir/dcp_io.py``).

A torch release that writes a file around ``FileSystemWriter.fs``, seeks in a write stream,
stops renaming ``.metadata.tmp`` through the file system, renames ``_StorageInfo`` or drops
the staging options fails here, not in a user's resume.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from boostlr.platform import pin_staging
from boostlr.rundir import dcp_io
from boostlr.rundir.checkpoint import list_checkpoints, sha256_of
from boostlr.rundir.writer import CheckpointWriter, prune_checkpoints, shard_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.randn(32, dtype=torch.bfloat16)},
        "optim": {"w": {"exp_avg": torch.randn(64, 32), "step": torch.tensor(3.0)}},
    }


def on_disk(path: Path) -> dict[str, dict]:
    return {
        f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in sorted(path.iterdir())
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_file_dcp_writes_is_hashed_as_written(tmp_path: Path, mode: str) -> None:
    writer = dcp_io.HashingFileSystemWriter(tmp_path)
    original = state()
    if mode == "sync":
        dcp_io.save(original, writer, None)
    else:
        stager = dcp_io.make_stager(pin=False)
        staged = dcp_io.stage_state(stager, original)
        assert staged["model"]["w"].data_ptr() != original["model"]["w"].data_ptr()
        dcp_io.async_save(staged, writer, None).result()
        stager.close()
    files = on_disk(tmp_path)
    assert ".metadata" in files and "__0_0.distcp" in files  # the layout boostlr lists
    assert writer.digests == files  # every file, its final name, bytes as on disk
    loaded = {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)},
        "optim": {"w": {"exp_avg": torch.zeros(64, 32), "step": torch.tensor(0.0)}},
    }
    dcp_io.load(loaded, tmp_path, None)  # through the allowlisted metadata reader
    assert torch.equal(loaded["model"]["w"], original["model"]["w"])
    assert torch.equal(loaded["model"]["b"], original["model"]["b"])
    assert torch.equal(loaded["optim"]["w"]["exp_avg"], original["optim"]["w"]["exp_avg"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shard_records_skip_the_zip_crc_and_still_load(tmp_path: Path, mode: str) -> None:
    """The sha256 covers the shards, so their records are written without torch's CRC-32
    (a torch that stops honouring the setting fails here); the setting is restored."""
    import zipfile

    from torch.utils.serialization import config

    writer = dcp_io.HashingFileSystemWriter(tmp_path)
    if mode == "sync":
        dcp_io.save(state(), writer, None)
    else:
        dcp_io.async_save(state(), writer, None).result()
    assert config.save.compute_crc32  # torch's default, back after the save
    metadata = dcp_io.SafeFileSystemReader(str(tmp_path)).read_metadata()
    crcs = []
    for info in metadata.storage_data.values():
        with open(tmp_path / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            record = io.BytesIO(fh.read(info.length))
        crcs += [entry.CRC for entry in zipfile.ZipFile(record).infolist()]
        record.seek(0)
        torch.load(record, weights_only=True)  # a plain torch.load reads the record
    assert len(crcs) > 3 and set(crcs) == {0}


def test_a_hashing_stream_only_writes_forward() -> None:
    raw = io.BytesIO()
    stream = dcp_io.HashingStream(raw)
    stream.write(b"abc")
    stream.write(memoryview(bytearray(b"defg")))
    assert stream.tell() == 7 and raw.getvalue() == b"abcdefg"
    assert stream.hexdigest() == hashlib.sha256(b"abcdefg").hexdigest()
    with pytest.raises(io.UnsupportedOperation):
        stream.seek(0)


def test_the_private_names_the_metadata_allowlist_and_staging_use_still_exist() -> None:
    import torch.distributed.checkpoint.filesystem as fs

    assert hasattr(fs, "_StorageInfo")
    assert hasattr(dcp_io.SafeFileSystemReader("."), "_get_metadata_path")
    assert hasattr(dcp_io.SafeFileSystemReader("."), "storage_data")  # BOOSTLR_SLOW_IO reads
    assert isinstance(dcp_io.HashingFileSystemWriter(".").fs, dcp_io.HashingFileSystem)
    assert not pin_staging(torch.device("cpu"))
    assert not pin_staging(None)


def tiny_save(writer: CheckpointWriter, step: int) -> None:
    writer.save(step, state(), {"step": step}, {"cpu": torch.get_rng_state()}, {}, {})


def test_a_save_lists_the_hashes_of_its_bytes_and_its_cost(tmp_path: Path) -> None:
    extra = tmp_path / "tokenizer.json"
    extra.write_text('{"tokenizer": true}')
    writer = CheckpointWriter(tmp_path / "ckpts", 0, None, keep=2)
    cost = writer.save(1, state(), {"step": 1}, {"cpu": torch.get_rng_state()}, {}, {"t": extra})
    writer.close()
    path = tmp_path / "ckpts" / "step_1"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["files"] == {k: v for k, v in on_disk(path).items() if k != "meta.json"}
    assert all(sha256_of(path / n) == e["sha256"] for n, e in meta["files"].items())
    assert cost.nbytes == shard_bytes(state()) == 64 * 32 * 4 * 2 + 32 * 2 + 4
    assert cost.nbytes_by_rank == [cost.nbytes] and cost.blocked_s_by_rank == [cost.blocked_s]
    row = cost.row()
    assert row["ckpt_block_s"] == cost.blocked_s > 0 and row["ckpt_bytes"] == cost.nbytes


def test_old_checkpoints_go_in_the_background_never_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    writer = CheckpointWriter(root, 0, None, keep=2, async_save=True)
    for step in (1, 2, 3, 4):
        tiny_save(writer, step)
    writer.close()  # waits for the save in flight and the deletions
    assert [c.step for c in list_checkpoints(root)] == [3, 4]
    # A re-save of an existing step replaces it; newer checkpoints (set aside at a resume)
    # and the one just written are never pruned.
    writer = CheckpointWriter(root, 0, None, keep=1)
    tiny_save(writer, 3)
    writer.close()
    assert [c.step for c in list_checkpoints(root)] == [3, 4]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert prune_checkpoints(root, keep=1, written=4) == [root / "step_3"]
    assert [c.step for c in list_checkpoints(root)] == [4]
