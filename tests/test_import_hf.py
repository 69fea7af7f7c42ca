"""``boostlr import-hf`` of a random local ``LlamaForCausalLM`` (nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from boostlr.cli import main
from boostlr.export import load_pretrained
from boostlr.import_hf import LINEARS, import_hf
from boostlr.models.llama import ATTN_LINEARS
from boostlr.rundir.checkpoint import list_checkpoints, load_model_state, open_checkpoint

transformers = pytest.importorskip("transformers")

DIM, FFN, LAYERS, HEADS = 64, 176, 2, 4


@pytest.fixture(scope="module")
def hf_dir(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LLaMA (norm gains perturbed too) with the small dataset's tokenizer."""
    vocab = json.loads((small_dataset / "manifest.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=256,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(out)
    shutil.copyfile(small_dataset / "tokenizer.json", out / "tokenizer.json")
    return out


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(tokens).logits


def _tokens() -> torch.Tensor:
    return torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))


def _direct_errors(hf_dir: Path, rank: int) -> dict[str, float]:
    from safetensors.torch import load_file

    weights = load_file(hf_dir / "model.safetensors")
    out = {}
    for layer in range(LAYERS):
        for name in LINEARS:
            owner = "self_attn" if name in ATTN_LINEARS else "mlp"
            key = f"layers.{layer}.{owner}.{name}"
            s = torch.linalg.svdvals(weights[f"model.{key}.weight"].double())
            out[key] = float(s[rank:].pow(2).sum().sqrt() / s.pow(2).sum().sqrt())
    return out


def test_full_import_is_exact(hf_dir: Path, tmp_path: Path) -> None:
    run = import_hf(hf_dir, tmp_path / "full", [("model.arch", "full")]).run_dir
    from safetensors.torch import load_file

    hf = load_file(hf_dir / "model.safetensors")
    ours = load_model_state(open_checkpoint(run))
    assert set(ours) == {k.removeprefix("model.") for k in hf}
    for key, value in ours.items():
        assert torch.equal(value, hf[key if key == "lm_head.weight" else f"model.{key}"]), key
    model, _ = load_pretrained(run)
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens)
    assert torch.equal(logits, _hf_logits(hf_dir, tokens))


def test_svd_full_rank_matches_and_low_rank_errors_are_the_svd_tail(
    hf_dir: Path, tmp_path: Path
) -> None:
    full_rank = import_hf(hf_dir, tmp_path / "r64", [("model.arch", "svd"), ("model.rank", "64")])
    assert max(full_rank.errors.values()) < 1e-6
    model, _ = load_pretrained(full_rank.run_dir)
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits, _hf_logits(hf_dir, tokens), atol=1e-4, rtol=1e-4)

    rank = DIM // 4
    low = import_hf(hf_dir, tmp_path / "r16", [("model.arch", "svd")])
    assert low.cfg.model.rank == rank and low.cfg.model.mlp == "swiglu"
    direct = _direct_errors(hf_dir, rank)
    assert set(low.errors) == set(direct) and len(direct) == 7 * LAYERS
    for key, value in direct.items():
        assert low.errors[key] == pytest.approx(value, rel=1e-5), key
        assert 0.3 < value < 1  # random weights: a rank-16 truncation loses a lot
    recorded = json.loads((low.run_dir / "import.json").read_text())
    meta = open_checkpoint(low.run_dir).meta["import"]
    assert recorded["reconstruction_error"] == meta["reconstruction_error"] == low.errors
    assert recorded["rank"] == rank
    assert recorded["max_error"] == pytest.approx(max(direct.values()), rel=1e-5)


def test_imported_run_resumes_evaluates_exports_and_generates(
    hf_dir: Path, small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = ["import-hf", str(hf_dir), "--out", str(run), "--model.arch", "cola"]
    # Training settings that fix the data order are chosen at import (resume keeps them).
    data = ["--data.path", str(small_dataset), "--data.seq_len", "32", "--train.batch_size", "2"]
    assert main([*args, *data]) == 0
    out = capsys.readouterr().out
    assert "relative reconstruction error" in out and "step_0" in out
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [0]
    code = main(["train", "--run-dir", str(run), "--resume", "--quiet", "--train.steps", "2"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [0, 2]
    capsys.readouterr()
    assert main(["eval", str(run), "--max-tokens", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 64
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    assert main(["generate", str(export), "--prompt", "def ", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize(
    ("remove", "extra", "message"),
    [
        ("tokenizer.json", [], "has no tokenizer.json"),
        ("model.safetensors", [], "has no *.safetensors weights"),
        (None, ["--model.dim", "32"], "--model.dim is fixed by"),
        (None, ["--model.arch", "lax"], "choose one of full, svd, cola"),
    ],
)
def test_bad_imports_exit_2_with_one_line(
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    remove: str | None,
    extra: list[str],
    message: str,
) -> None:
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    if remove:
        (src / remove).unlink()
    assert main(["import-hf", str(src), "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_data_with_another_tokenizer_is_refused(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boostlr.data import prepare_dataset

    text = tmp_path / "t.txt"
    text.write_text("some other text to train another tokenizer on " * 50)
    other = tmp_path / "other"
    prepare_dataset([text], other, tokenizer="bpe:300", val_fraction=0.0, progress=False)
    args = ["import-hf", str(hf_dir), "--out", str(tmp_path / "run"), "--data.path", str(other)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenized with another tokenizer" in err[0], err
