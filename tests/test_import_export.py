"""Round trip: ``boostlr import-hf`` takes boostlr's own low-rank exports back, factors as is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_cases import (
    perturbed_model,
    prepare_words,
    random_tokens,
    run_config,
    write_checkpoint,
)
from export_cases import write_tokenizer as _write_tokenizer

from boostlr.cli import main
from boostlr.export import export_checkpoint, load_pretrained
from boostlr.rundir.checkpoint import list_checkpoints, load_model_state, open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def words_dataset(tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path) -> Path:
    return prepare_words(tmp_path_factory.mktemp("words"), tokenizer_file)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("svd", [("model.n_kv_heads", "2")]),
        ("cola", []),
        ("lax", [("model.lax_gate", "full"), ("model.tie_embeddings", "true")]),
    ],
    ids=["svd-gqa", "cola", "lax-full-tied"],
)
def test_lowrank_export_imports_exactly_and_resumes_training(
    tmp_path: Path,
    tokenizer_file: Path,
    words_dataset: Path,
    capsys: pytest.CaptureFixture[str],
    arch: str,
    overrides: list[tuple[str, str]],
) -> None:
    cfg = run_config(arch, *overrides)
    model = perturbed_model(cfg)
    export = export_checkpoint(
        write_checkpoint(tmp_path / "orig", cfg, model, tokenizer_file), tmp_path / "export"
    )
    run = tmp_path / "run"
    data = ["--data.path", str(words_dataset), "--data.seq_len", "16", "--train.batch_size", "2"]
    assert main(["import-hf", str(export), "--out", str(run), *data]) == 0
    out = capsys.readouterr().out
    assert f"as arch {arch}" in out and "reconstruction error" not in out  # no SVD

    ckpt = open_checkpoint(run)
    assert (
        ckpt.meta["config"]["model"] == json.loads((export / "config.json").read_text())["boostlr"]
    )
    assert ckpt.meta["import"]["method"] == "copy"
    state = load_model_state(ckpt)
    for name, tensor in model.state_dict().items():
        if not (cfg.model.tie_embeddings and name == "lm_head.weight"):
            assert torch.equal(state[name], tensor), name
    imported, _ = load_pretrained(run)
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(imported(tokens), model(tokens))

    code = main(["train", "--run-dir", str(run), "--resume", "--quiet", "--train.steps", "2"])
    assert code == 0, capsys.readouterr().err
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [0, 2]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_export_import_refuses_model_overrides(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = run_config("cola")
    export = export_checkpoint(
        write_checkpoint(tmp_path / "orig", cfg, perturbed_model(cfg), tokenizer_file),
        tmp_path / "export",
    )
    args = ["import-hf", str(export), "--out", str(tmp_path / "run"), "--model.arch", "svd"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model.arch" in err[0] and "boostlr export" in err[0], err
    assert not (tmp_path / "run").exists()
