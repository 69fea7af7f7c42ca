"""Data pipeline: corpus discovery, tokenizer, atomic dataset preparation, batch loading."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from boostlr.data import (
    EOS_TOKEN,
    BatchLoader,
    TokenDataset,
    default_corpus_files,
    default_dataset,
    discover_files,
    eos_id,
    iter_documents,
    load_manifest,
    load_tokenizer,
    prepare_dataset,
    resolve_tokenizer,
    train_bpe,
    val_batches,
    validate_dataset,
)
from boostlr.data import prepare as prepare_module
from boostlr.errors import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def _write_corpus(root: Path, n_docs: int = 40) -> Path:
    """A small corpus of text files with a little variety so BPE has something to merge."""
    root.mkdir(parents=True, exist_ok=True)
    words = WORDS.split()
    for i in range(n_docs):
        body = " ".join(words[(i + j) % len(words)] for j in range(200))
        (root / f"doc{i:03d}.txt").write_text(f"Document {i}.\n{body}\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    corpus = _write_corpus(root / "corpus")
    out = root / "prepared"
    prepare_dataset([corpus], out, tokenizer="bpe:300", val_fraction=0.1, progress=False)
    return out


@pytest.fixture(scope="module")
def arange_dir(dataset_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset whose token i is i, split over two shards, so windows identify themselves."""
    out = tmp_path_factory.mktemp("arange")
    manifest = load_manifest(dataset_dir)
    shards = []
    for k, (lo, hi) in enumerate([(0, 1000), (1000, 2501)]):
        tokens = np.arange(lo, hi, dtype="<u4")
        tokens.tofile(out / f"train_{k:05d}.bin")
        shards.append({"file": f"train_{k:05d}.bin", "tokens": len(tokens), "sha256": ""})
    manifest.update(dtype="uint32", vocab_size=70000)
    manifest["splits"] = {
        "train": {"tokens": 2501, "shards": shards},
        "val": {"tokens": 0, "shards": []},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "tokenizer.json").write_bytes((dataset_dir / "tokenizer.json").read_bytes())
    return out


# --- corpus -------------------------------------------------------------------------------------


def test_discover_and_iter_all_formats(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    (tmp_path / "sub" / ".hidden").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("plain text", encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text("# markdown", encoding="utf-8")
    (tmp_path / "sub" / "c.py").write_bytes(b"x = 1  # \xff bad utf-8")
    (tmp_path / "sub" / ".hidden" / "d.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "e.jsonl").write_text('{"text": "json one"}\n\n{"text": "json two"}\n')
    (tmp_path / "ignored.bin").write_bytes(b"\0")
    pq.write_table(pa.table({"text": ["pq one", None, "pq two"]}), tmp_path / "f.parquet")

    files = discover_files([tmp_path, tmp_path / "a.txt"])
    assert [f.name for f in files] == ["a.txt", "e.jsonl", "f.parquet", "b.md", "c.py"]
    docs = list(iter_documents(files))
    assert docs == ["plain text", "json one", "json two", "pq one", "pq two", "# markdown",
                    "x = 1  # \ufffd bad utf-8"]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "match"), [("{not json", r"bad\.jsonl:2: invalid JSON"), ('{"txt": 1}', r":2: .*text")]
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=match):
        list(iter_documents([path]))


def test_discover_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        discover_files([tmp_path / "missing"])
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(DataError, match="no usable files"):
        discover_files([tmp_path])
    with pytest.raises(DataError, match="unsupported type"):
        discover_files([tmp_path / "x.bin"])


def test_default_corpus_files_are_stdlib_sources_without_tests() -> None:
    files = default_corpus_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    excluded = {"test", "tests", "idlelib", "site-packages", "tkinter", "__pycache__"}
    assert not any(excluded & set(f.parts) for f in files)
    assert files == sorted(files)


# --- tokenizer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_bpe([WORDS * 20, "def f(x):\n    return x + 1\n"] * 5, 300)


@pytest.mark.parametrize(
    "text",
    ["hello world, def f(x): return x\n\tindented", "naïve café — 日本語 😀 \u0000 end", EOS_TOKEN],
)
def test_tokenizer_round_trip(small_tokenizer, text: str) -> None:
    small_tokenizer.encode_special_tokens = True
    ids = small_tokenizer.encode(text).ids
    assert small_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert 0 not in ids  # document text never yields the EOS separator
    small_tokenizer.encode_special_tokens = False


def test_tokenizer_eos_is_id_zero_and_reloads(small_tokenizer, tmp_path: Path) -> None:
    assert eos_id(small_tokenizer) == 0
    small_tokenizer.save(str(tmp_path / "tokenizer.json"))
    for spec in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = resolve_tokenizer(str(spec), documents_factory=lambda: pytest.fail("trained"))
        assert loaded.encode("alpha beta").ids == small_tokenizer.encode("alpha beta").ids


@pytest.mark.parametrize(
    ("spec", "match"),
    [("bpe:abc", "bad tokenizer spec"), ("bpe:100", "too small"), ("no/such/dir", "not found")],
)
def test_bad_tokenizer_specs(spec: str, match: str) -> None:
    with pytest.raises(DataError, match=match):
        resolve_tokenizer(spec, documents_factory=lambda: [])


def test_load_tokenizer_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path))


# --- prepare ------------------------------------------------------------------------------------


def test_prepare_writes_consistent_manifest(dataset_dir: Path) -> None:
    manifest = validate_dataset(dataset_dir, check_checksums=True)
    assert manifest == load_manifest(dataset_dir)
    assert manifest["dtype"] == "uint16" and manifest["eos_id"] == 0
    assert manifest["documents"] == {"train": 36, "val": 4, "total": 40}
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        lengths = [(dataset_dir / s["file"]).stat().st_size // 2 for s in entry["shards"]]
        assert entry["tokens"] == sum(lengths) > 0
    train = np.fromfile(dataset_dir / "train_00000.bin", dtype="<u2")
    assert (train == 0).sum() == 36 and train[-1] == 0  # one EOS per document
    assert sorted(p.name for p in dataset_dir.parent.iterdir()) == ["corpus", "prepared"]


def test_prepare_splits_into_shards_deterministically(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", n_docs=10)
    a = prepare_dataset([corpus], tmp_path / "a", "bpe:300", shard_tokens=1000, progress=False)
    b = prepare_dataset([corpus], tmp_path / "b", "bpe:300", shard_tokens=1000, progress=True)
    assert len(a["splits"]["train"]["shards"]) > 1
    assert all(s["tokens"] == 1000 for s in a["splits"]["train"]["shards"][:-1])
    assert a["splits"] == b["splits"]
    assert a["documents"]["val"] == 1  # 1% of 10 documents still gives one
    ds = TokenDataset(tmp_path / "a", "train")
    joined = np.concatenate([np.fromfile(tmp_path / "a" / s["file"], "<u2")
                             for s in a["splits"]["train"]["shards"]])  # fmt: skip
    assert np.array_equal(ds.tokens(990, 30), joined[990:1020])


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("newline.txt", "\n"),
        ("blank.md", " \t\r\n  \n"),
        ("empty.txt", ""),
        ("blank.jsonl", '{"text": "\\n"}\n\n{"text": "   "}\n'),
    ],
)
def test_prepare_without_text_is_an_error(tmp_path: Path, name: str, content: str) -> None:
    """Whitespace-only input is refused (it used to become a 2-token dataset), nothing written."""
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=rf"{name} contains no text.*pass files with text"):
        prepare_dataset([path], tmp_path / "out", "bpe:300", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_prepare_keeps_text_next_to_blank_files(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", n_docs=2)
    (corpus / "blank.txt").write_text("\n")
    manifest = prepare_dataset([corpus], tmp_path / "out", "bpe:300", progress=False)
    assert manifest["documents"]["total"] == 3


def test_prepare_refuses_existing_dataset_without_overwrite(dataset_dir: Path) -> None:
    with pytest.raises(DataError, match="--overwrite"):
        prepare_dataset([dataset_dir.parent / "corpus"], dataset_dir, "bpe:300", progress=False)


def test_prepare_refuses_unrelated_nonempty_dir(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", n_docs=3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare_dataset([corpus], tmp_path / "out", "bpe:300", progress=False, overwrite=True)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_prepare_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = _write_corpus(tmp_path / "corpus", n_docs=6)
    out = tmp_path / "out"

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(prepare_module, "_write_json", boom)
        with pytest.raises(RuntimeError, match="disk full"):
            prepare_dataset([corpus], out, "bpe:300", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # no out, no temp dir

    before = prepare_dataset([corpus], out, "bpe:300", progress=False)
    with monkeypatch.context() as m:
        m.setattr(prepare_module._ShardWriter, "close", boom)
        with pytest.raises(RuntimeError, match="disk full"):
            prepare_dataset([corpus], out, "bpe:400", progress=False, overwrite=True)
    assert validate_dataset(out, check_checksums=True) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]

    after = prepare_dataset([corpus], out, "bpe:400", progress=False, overwrite=True)
    assert after["tokenizer"] == "bpe:400" and load_manifest(out) == after


def test_validate_reports_damage(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", n_docs=4)
    out = tmp_path / "out"
    with pytest.raises(DataError, match="boostlr prepare --input"):
        validate_dataset(out)
    prepare_dataset([corpus], out, "bpe:300", progress=False)
    shard = out / "train_00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    validate_dataset(out)  # sizes still fine
    with pytest.raises(DataError, match="checksum"):
        validate_dataset(out, check_checksums=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="bytes, expected"):
        validate_dataset(out)
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        TokenDataset(out, "train")


# --- loader -------------------------------------------------------------------------------------


def test_dataset_metadata(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    assert ds.vocab_size <= 300 and ds.eos_id == 0 and ds.tokenizer_path.is_file()
    assert len(ds) == load_manifest(dataset_dir)["splits"]["train"]["tokens"]


def test_batches_are_shifted_windows_across_shards(arange_dir: Path) -> None:
    ds = TokenDataset(arange_dir, "train")
    loader = BatchLoader(ds, batch_size=5, seq_len=100, seed=0)
    assert loader.num_windows == 25 and len(loader) == 5
    seen = []
    for _ in range(5):
        x, y = next(loader)
        assert x.shape == y.shape == (5, 100) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # targets are inputs shifted by one token
        assert torch.all(x[:, 0] % 100 == 0)  # windows start at multiples of seq_len
        seen += (x[:, 0] // 100).tolist()
    assert sorted(seen) == list(range(25))  # an epoch visits every window once


def test_loader_is_deterministic_and_resumes_exactly(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    loader = BatchLoader(ds, batch_size=4, seq_len=32, seed=7)
    steps = loader.batches_per_epoch + 3  # cross an epoch boundary
    reference = [next(loader) for _ in range(steps)]
    again = BatchLoader(ds, batch_size=4, seq_len=32, seed=7)
    for _ in range(5):
        next(again)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = BatchLoader(ds, batch_size=4, seq_len=32, seed=7)
    resumed.load_state_dict(state)
    for want in reference[5:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert resumed.state_dict()["epoch"] == 1
    other_seed = next(BatchLoader(ds, batch_size=4, seq_len=32, seed=8))
    assert not torch.equal(other_seed[0], reference[0][0])


def test_dp_ranks_get_disjoint_windows(arange_dir: Path) -> None:
    ds = TokenDataset(arange_dir, "train")
    ranks = [BatchLoader(ds, 2, 16, seed=3, dp_rank=r, dp_size=3) for r in range(3)]
    single = BatchLoader(ds, 6, 16, seed=3)
    windows: list[int] = []
    for _ in range(ranks[0].batches_per_epoch):
        per_rank = [next(loader)[0] for loader in ranks]
        assert torch.equal(torch.cat(per_rank), next(single)[0])
        windows += torch.cat(per_rank)[:, 0].tolist()
    assert len(windows) == len(set(windows)) == 6 * ranks[0].batches_per_epoch


def test_too_small_dataset_errors(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "val")
    with pytest.raises(DataError, match="reduce the batch size or seq_len"):
        BatchLoader(ds, batch_size=64, seq_len=len(ds), seed=0)
    with pytest.raises(DataError, match="unknown split"):
        TokenDataset(dataset_dir, "test")


def test_val_batches_are_first_windows_in_order(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "val")
    batches = val_batches(ds, batch_size=3, seq_len=8, max_batches=2)
    assert [b[0].shape[0] for b in batches] == [3, 3]
    assert torch.equal(batches[1][0][0], torch.from_numpy(ds.tokens(3 * 8, 8)))
    repeat = val_batches(ds, batch_size=3, seq_len=8, max_batches=2)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, repeat, strict=True))
    everything = val_batches(ds, batch_size=1000, seq_len=8, max_batches=10)
    assert len(everything) == 1 and everything[0][0].shape[0] == (len(ds) - 1) // 8


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_dataset_is_built_once_and_reused(tmp_path: Path) -> None:
    start = time.perf_counter()
    path = default_dataset(tmp_path, progress=False)
    elapsed = time.perf_counter() - start
    manifest = validate_dataset(path, check_checksums=True)
    tokens = {split: manifest["splits"][split]["tokens"] for split in ("train", "val")}
    print(f"\ndefault_dataset: {elapsed:.1f}s, {manifest['source']}, tokens={tokens}")
    assert path.name.startswith("stdlib-py") and path.name.endswith("-bpe4096")
    assert manifest["vocab_size"] == 4096 and manifest["splits"]["val"]["tokens"] > 0
    mtime = os.stat(path / "manifest.json").st_mtime_ns
    assert default_dataset(tmp_path, progress=False) == path
    assert os.stat(path / "manifest.json").st_mtime_ns == mtime
