"""``boostlr eval``: agreement with the trainer's validation loss, and bits per byte by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from boostlr.cli import main
from boostlr.config import build_config
from boostlr.data import TokenDataset, prepare_dataset
from boostlr.evaluate import evaluate_dataset, run_eval, windows
from boostlr.export import export_checkpoint
from boostlr.models.llama import build_model
from boostlr.train import run as trainer

DOCS = ["Hello wörld, ∑ café — naïve 日本語 text.", "Zweites Dokument: Grüße, €5 and 🙂 too."]


def _tiny_run(data: Path, run: Path) -> float:
    cfg = build_config(
        overrides=[
            ("model.preset", "tiny"),
            ("model.arch", "cola"),
            ("data.path", str(data)),
            ("data.seq_len", "32"),
            ("data.val_batches", "2"),
            ("train.batch_size", "4"),
            ("train.steps", "3"),
            ("train.eval_every", "3"),
            ("parallel.device", "cpu"),
        ]
    )
    result = trainer.train(cfg, run, console=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert last == pytest.approx(result.val_loss)
    return last


def test_eval_equals_the_runs_val_loss(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    val_loss = _tiny_run(small_dataset, run)
    same_batches = 2 * 4 * 32  # data.val_batches x batch_size x seq_len targets
    by_run = run_eval(run, "val", max_tokens=same_batches, progress=False)
    assert by_run.tokens == same_batches
    assert by_run.loss == pytest.approx(val_loss, rel=1e-6)
    step_dir = run / "checkpoints" / "step_3"
    by_ckpt = run_eval(step_dir, "val", max_tokens=same_batches, progress=False)
    assert by_ckpt.loss == by_run.loss
    export = export_checkpoint(run, tmp_path / "export")
    by_export = run_eval(
        export,
        "val",
        max_tokens=same_batches,
        overrides=[("data.path", str(small_dataset)), ("data.seq_len", "32")],
        progress=False,
    )
    assert by_export.loss == pytest.approx(by_run.loss, rel=1e-6)
    # The whole split: every token after the first is a target once.
    whole = run_eval(run, "val", progress=False)
    assert whole.tokens == len(TokenDataset(small_dataset, "val")) - 1
    assert whole.bytes > whole.tokens  # a 512-token BPE averages more than a byte a token


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("text")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    out = root / "data"
    prepare_dataset([src], out, tokenizer="bpe:300", val_fraction=0.0, progress=False)
    return out


def test_bits_per_byte_by_hand(text_dataset: Path) -> None:
    tok = Tokenizer.from_file(str(text_dataset / "tokenizer.json"))
    ds = TokenDataset(text_dataset, "train")
    stream = torch.from_numpy(ds.tokens(0, len(ds)))
    ids = [tok.encode(d, add_special_tokens=False).ids for d in DOCS]
    eos = tok.token_to_id("<|endoftext|>")
    assert stream.tolist() == ids[0] + [eos] + ids[1] + [eos]
    first = tok.decode(ids[0][:1]).encode("utf-8")
    assert first.isascii()  # the first token is never a target: its bytes are not counted
    hand_bytes = sum(len(d.encode("utf-8")) for d in DOCS) - len(first)

    cfg = build_config(overrides=[("model.preset", "tiny"), ("model.arch", "full")]).model
    cfg.vocab_size = ds.vocab_size
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():  # one window over everything
        logits = model(stream[None, :-1])
        nats = float(F.cross_entropy(logits[0], stream[1:], reduction="sum"))
    result = evaluate_dataset(model, ds, tok, seq_len=len(stream), batch_size=1)
    assert result.bytes == hand_bytes
    assert result.tokens == len(stream) - 1
    assert result.loss == pytest.approx(nats / (len(stream) - 1), rel=1e-6)
    assert result.bits_per_byte == pytest.approx(nats / math.log(2) / hand_bytes, rel=1e-6)

    # Windows of 7 in batches of 3: the same targets, each window with its own context.
    with torch.no_grad():
        windowed = 0.0
        for start in range(0, len(stream) - 1, 7):
            chunk = stream[start : start + 8]
            out = model(chunk[None, :-1])
            windowed += float(F.cross_entropy(out[0], chunk[1:], reduction="sum"))
    small = evaluate_dataset(model, ds, tok, seq_len=7, batch_size=3)
    assert small.bytes == hand_bytes and small.tokens == result.tokens
    assert small.nats == pytest.approx(windowed, rel=1e-6)


def test_windows_cover_each_target_once() -> None:
    for n, seq, cap in [(1, 4, None), (2, 4, None), (9, 4, None), (100, 7, None), (100, 7, 30)]:
        spans = windows(n, seq, cap)
        targets = [t for start, length in spans for t in range(start + 1, start + 1 + length)]
        expected = min(n - 1, cap) if cap is not None else n - 1
        assert targets == list(range(1, expected + 1))
        assert all(0 < length <= seq for _, length in spans)


def test_cli_eval_json_and_errors(
    small_dataset: Path, text_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _tiny_run(small_dataset, run)
    capsys.readouterr()
    code = main(["eval", str(run), "--max-tokens", "100", "--json", "--train.batch_size", "2"])
    out, _ = capsys.readouterr()
    assert code == 0
    record = json.loads(out)
    assert set(record) == {"loss", "ppl", "bits_per_byte", "tokens", "bytes"}
    assert record["tokens"] == 100 and record["ppl"] == pytest.approx(math.exp(record["loss"]))
    for args, message in [
        (["eval", str(tmp_path / "nope")], f"{tmp_path / 'nope'} does not exist"),
        (["eval", str(run / "checkpoints")], "not a checkpoint"),
        (["eval", str(run), "--model.dim", "32"], "does not take --model.dim"),
        (["eval", str(run), "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["eval", str(run), "--data.path", str(text_dataset)], "with another tokenizer"),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_an_export_without_data_path_evaluates_on_matching_data_or_says_so_first(
    small_dataset: Path,
    text_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An export holds no dataset. A freshly prepared default corpus would have a tokenizer
    of its own, so none is prepared: the prepared default corpus of the export's vocabulary
    is used when it has the export's tokenizer, and otherwise one line says what to pass."""
    import shutil

    from boostlr.data.prepare import default_dataset_dir

    run = tmp_path / "run"
    _tiny_run(small_dataset, run)
    export = export_checkpoint(run, tmp_path / "export")
    cache = tmp_path / "cache"
    monkeypatch.setenv("BOOSTLR_CACHE", str(cache))
    capsys.readouterr()
    assert main(["eval", str(export), "--data.seq_len", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an export and holds no dataset" in err[0], err
    assert "is not prepared" in err[0] and "--tokenizer" in err[0]
    assert not cache.exists() or not any(cache.iterdir())  # nothing prepared on the way

    default = default_dataset_dir(vocab_size=512)  # the export's vocabulary
    shutil.copytree(text_dataset, default)  # prepared, but with another tokenizer
    assert main(["eval", str(export), "--data.seq_len", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has another tokenizer" in err[0], err

    shutil.rmtree(default)
    shutil.copytree(small_dataset, default)  # the run's own data, as the default corpus
    by_export = run_eval(export, "val", overrides=[("data.seq_len", "32")], progress=False)
    by_run = run_eval(run, "val", progress=False)
    assert by_export.tokens == by_run.tokens and by_export.loss == pytest.approx(by_run.loss)
