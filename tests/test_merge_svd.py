"""``boostlr export --merge-svd``: an svd model as a plain LLaMA, exact up to fp32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_cases import perturbed_model, random_tokens, run_config, write_checkpoint
from export_cases import write_tokenizer as _write_tokenizer
from safetensors.torch import load_file

from boostlr.cli import main
from boostlr.export import load_pretrained
from boostlr.hf import REMOTE_CODE_FILES

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SWIGLU = ("model.mlp", "swiglu")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize(
    "overrides",
    [
        [SWIGLU],
        [
            SWIGLU,
            ("model.n_heads", "4"),
            ("model.n_kv_heads", "2"),
            ("model.tie_embeddings", "true"),
        ],
    ],
    ids=["mha", "gqa-tied"],
)
def test_merged_svd_is_a_plain_llama_with_the_same_logits(
    tmp_path: Path, tokenizer_file: Path, overrides: list[tuple[str, str]]
) -> None:
    cfg = run_config("svd", *overrides)
    model = perturbed_model(cfg)
    ckpt = write_checkpoint(tmp_path / "run", cfg, model, tokenizer_file)
    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--out", str(out), "--merge-svd"]) == 0

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and config["boostlr"]["arch"] == "full"
    assert not any((out / name).exists() for name in REMOTE_CODE_FILES)
    tensors = load_file(out / "model.safetensors")
    assert not any(".down." in k or ".up." in k for k in tensors)
    state = model.state_dict()
    for layer in range(cfg.model.n_layers):
        for key in ("self_attn.k_proj", "mlp.down_proj"):
            name = f"layers.{layer}.{key}"
            product = state[f"{name}.up.weight"].double() @ state[f"{name}.down.weight"].double()
            assert torch.equal(tensors[f"model.{name}.weight"], product.float())

    # No remote code: the class transformers itself ships.
    hf, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    auto = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(auto) is transformers.LlamaForCausalLM
    tokens = random_tokens()
    with torch.no_grad():
        ours = model(tokens)
        torch.testing.assert_close(hf.eval()(input_ids=tokens).logits, ours, atol=1e-5, rtol=0)
        merged, _ = load_pretrained(out)
        assert merged.cfg.arch == "full"
        torch.testing.assert_close(merged(tokens), ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "arch,overrides,message",
    [
        ("cola", [], "arch cola computes"),
        ("lax", [], "arch lax computes"),
        ("svd", [], "model.mlp lowrank-only"),
        ("svd", [("model.mlp", "lowrank-only")], "model.mlp lowrank-only"),
        ("full", [], "already dense"),
    ],
)
def test_unmergeable_archs_exit_2_with_one_line(
    tmp_path: Path,
    tokenizer_file: Path,
    capsys: pytest.CaptureFixture[str],
    arch: str,
    overrides: list[tuple[str, str]],
    message: str,
) -> None:
    cfg = run_config(arch, *overrides)
    ckpt = write_checkpoint(tmp_path / "run", cfg, perturbed_model(cfg), tokenizer_file)
    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--out", str(out), "--merge-svd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "--merge-svd" in err[0], err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
