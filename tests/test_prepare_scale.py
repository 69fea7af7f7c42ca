"""``boostlr prepare`` at scale: the encoding pipeline, HF datasets inputs, progress, signals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from boostlr.cli import main
from boostlr.data import EOS_TOKEN, TokenDataset, eos_id, prepare_dataset, train_bpe
from boostlr.data.corpus import TEXT_PIECE_BYTES, iter_text_pieces
from boostlr.data.encode import encode_stream
from boostlr.data.progress import Meter

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def _docs(n: int = 60) -> list[str]:
    words = WORDS.split()
    docs = [" ".join(words[(i * 3 + j) % len(words)] for j in range(10 + 7 * i)) for i in range(n)]
    docs[5] = f"text with a literal {EOS_TOKEN} inside"
    docs[9] = "ünïcödé ✓ 数字\n\n\tindented"
    return docs


def test_pipeline_encodes_each_document_as_one_encode_call(monkeypatch) -> None:
    docs = _docs()
    tok = train_bpe(docs, 300)
    meter = Meter()
    # Small batches: many batches in flight through reader, encoder and caller.
    out = list(encode_stream(tok, iter(docs), 0, np.dtype("<u2"), meter, batch_chars=200))
    assert [i for i, _ in out] == list(range(len(docs)))
    tok.encode_special_tokens = True
    for (_, ids), doc in zip(out, docs, strict=True):
        assert ids[:-1].tolist() == tok.encode(doc, add_special_tokens=False).ids
        assert ids[-1] == 0
    tok.encode_special_tokens = False
    assert meter.docs == len(docs) and meter.tokens == sum(len(ids) for _, ids in out)
    assert meter.bytes == sum(len(d.encode("utf-8")) for d in docs)
    assert out[5][1][:-1].tolist().count(0) == 0  # the literal EOS is text


def test_a_reader_error_reaches_the_caller() -> None:
    def broken():
        yield "alpha beta"
        raise OSError("disk gone")

    tok = train_bpe(_docs(), 300)
    with pytest.raises(OSError, match="disk gone"):
        list(encode_stream(tok, broken(), 0, np.dtype("<u2"), Meter(), batch_chars=1))


def test_hf_datasets_directories_are_inputs(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = _docs()
    single = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    single.save_to_disk(str(tmp_path / "ds"))
    both = datasets.DatasetDict({"a": single.select(range(40)), "b": single.select(range(40, 60))})
    both.save_to_disk(str(tmp_path / "dd"))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tmp_path / "tok.json"
    train_bpe(docs, 300).save(str(tok))

    def tokens(src: Path, name: str) -> np.ndarray:
        prepare_dataset([src], tmp_path / name, str(tok), val_fraction=0.0, progress=False)
        data = TokenDataset(tmp_path / name, "train")
        return data.tokens(0, len(data))

    expected = tokens(jsonl, "from_jsonl")
    assert (expected == 0).sum() == len(docs)
    assert np.array_equal(tokens(tmp_path / "ds", "from_ds"), expected)
    assert np.array_equal(tokens(tmp_path / "dd", "from_dd"), expected)  # splits a, b in order


def test_arrow_without_text_column_is_one_line_error(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "ds"))
    capsys.readouterr()  # datasets' own progress
    args = ["prepare", "--input", str(tmp_path / "ds"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no 'text' column (columns: body)" in err[0], err


def test_every_phase_shows_throughput(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then treats stderr as a terminal
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    args = ["prepare", "--input", str(jsonl), "--out", str(tmp_path / "out")]
    stats = tmp_path / "stats.json"
    assert main([*args, "--tokenizer", "bpe:300", "--stats", str(stats)]) == 0
    captured = capsys.readouterr()
    for name in ("scan", "tokenizer", "merges", "encode"):
        assert name in captured.err, name
    assert "MB/s" in captured.err and "tok/s" in captured.err and "docs" in captured.err
    phases = {p["phase"]: p for p in json.loads(stats.read_text())}
    assert list(phases) == ["scan", "tokenizer", "merges", "encode"]
    for record in phases.values():
        assert record["wall_s"] > 0 and record["cpu_s"] >= 0 and record["cores"] >= 0
    assert phases["tokenizer"]["docs"] == phases["encode"]["docs"] == len(_docs())
    assert set(phases["encode"]["stage_cores"]) == {"read", "write", "tokenise"}
    assert "time: scan" in captured.out and "cores" in captured.out


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_only_boostlr_draws_bars_while_training_a_tokenizer(tmp_path: Path) -> None:
    """On a terminal the tokenizers library would draw its own bars; prepare turns them off."""
    import pty

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    cmd = [sys.executable, "-m", "boostlr.cli", "prepare", "--input", str(jsonl)]
    cmd += ["--out", str(tmp_path / "out"), "--tokenizer", "bpe:300"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, env=env, stdout=follower, stderr=follower)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, output
    text = output.decode("utf-8", errors="replace")
    assert "wrote" in text and "encode" in text
    for theirs in ("Pre-processing sequences", "Tokenize words", "Count pairs", "merges]"):
        assert theirs not in text, theirs


def _book(n_bytes: int, seed: int = 0) -> str:
    """Paragraphs of multi-byte text, and one long line with no line break at all."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "ünïcödé", "✓", "数字", "𝔘𝔫𝔦"]
    paragraphs, size = [], 0
    while size < n_bytes:
        lines = [" ".join(rng.choices(words, k=rng.randrange(3, 15))) for _ in range(3)]
        paragraphs.append("\n".join(lines))
        size += len(paragraphs[-1].encode("utf-8")) + 2
        if len(paragraphs) == 40:
            paragraphs.append("数字𝔘" * 5000)  # 50 kB, longer than a test's piece: hard cuts
    return "\n\n".join(paragraphs)


def test_a_big_text_file_is_read_in_bounded_pieces(tmp_path: Path) -> None:
    text = _book(2_000_000)
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    piece = 16 * 1024
    tracemalloc.start()
    try:
        pieces = list(iter_text_pieces(path, piece))
        peak = tracemalloc.get_traced_memory()[1] - sum(sys.getsizeof(p) for p in pieces)
    finally:
        tracemalloc.stop()
    assert "".join(pieces) == text  # no character lost or split
    assert all(len(p.encode("utf-8")) <= piece for p in pieces)
    assert len(pieces) > 2_000_000 // piece
    ends = [p.endswith("\n\n") for p in pieces[:-1]]
    assert sum(ends) > 0.8 * len(ends)  # mostly between paragraphs
    assert peak < 16 * piece, peak  # not the file's size


def test_one_big_text_file_is_many_documents_with_a_val_split(tmp_path: Path) -> None:
    text = _book(3 * TEXT_PIECE_BYTES + 1000, seed=1)
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    tok = tmp_path / "tok.json"
    train_bpe([text[:20_000]], 300).save(str(tok))
    manifest = prepare_dataset(
        [path], tmp_path / "data", str(tok), val_fraction=0.25, progress=False
    )
    pieces = list(iter_text_pieces(path))
    assert len(pieces) >= 4 and manifest["documents"]["total"] == len(pieces)
    assert manifest["documents"]["val"] == round(0.25 * len(pieces))
    tokenizer = Tokenizer.from_file(str(tok))
    docs = []
    for split in ("train", "val"):
        data = TokenDataset(tmp_path / "data", split)
        ids = data.tokens(0, len(data)).tolist()
        assert ids[-1] == 0
        docs += [tokenizer.decode(d) for d in _split_at(ids, 0)]
    assert sorted(docs) == sorted(pieces)


def _split_at(ids: list[int], eos: int) -> list[list[int]]:
    docs, start = [], 0
    for i, token in enumerate(ids):
        if token == eos:
            docs.append(ids[start:i])
            start = i + 1
    return docs


def _stdlib_corpus(root: Path, copies: int) -> Path:
    """Real text: the stdlib's top-level sources, ``copies`` times, one .txt file each."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir()
    for k in range(copies):
        for i, source in enumerate(sorted(stdlib.glob("*.py"))):
            (root / f"{k:02d}_{i:04d}.txt").write_bytes(source.read_bytes())
    return root


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM semantics")
def test_sigterm_leaves_no_dataset_and_a_rerun_works(tmp_path: Path) -> None:
    corpus = _stdlib_corpus(tmp_path / "corpus", copies=2)
    tok = tmp_path / "tok.json"
    train_bpe([p.read_text() for p in sorted(corpus.iterdir())[:40]], 2000).save(str(tok))
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "boostlr.cli", "prepare", "--input", str(corpus)]
    cmd += ["--out", str(out), "--tokenizer", str(tok)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(tmp_path.glob(".data.tmp-*/tokenizer.json")):  # encoding begins
        assert proc.poll() is None and time.monotonic() < deadline, "finished before the signal"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "tok.json"]

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    data = TokenDataset(out, "train")
    tokenizer = json.loads((out / "manifest.json").read_text())
    assert tokenizer["documents"]["total"] == len(list(corpus.iterdir()))
    assert data.eos_id == eos_id(train_bpe(["x"], 300))
