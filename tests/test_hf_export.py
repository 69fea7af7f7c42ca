"""Exports as real Hugging Face models: remote code for the low-rank archs, tokenizer files.

Everything goes through real ``transformers`` (``AutoModelForCausalLM`` with
``trust_remote_code=True`` loads the ``modeling_boostlr.py`` copied into the export).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_cases import (
    VOCAB,
    WORDS,
    load_remote,
    perturbed_model,
    random_tokens,
    run_config,
    write_checkpoint,
)
from export_cases import write_tokenizer as _write_tokenizer
from tokenizers import Tokenizer

from boostlr.data.tokenizer import EOS_TOKEN, eos_id
from boostlr.export import export_checkpoint
from boostlr.hf import HF_DIR, REMOTE_CODE_FILES

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LOWRANK_CASES = [
    ("cola", []),
    ("svd", [("model.n_heads", "4"), ("model.n_kv_heads", "2")]),
    ("lax", [("model.n_heads", "4"), ("model.n_kv_heads", "2"), ("model.tie_embeddings", "true")]),
    ("lax", [("model.lax_gate", "full"), ("model.rope_theta", "500000")]),
]
LOWRANK_IDS = ["cola", "svd-gqa", "lax-factored-gqa-tied", "lax-full-theta"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _export(root: Path, arch: str, overrides, tokenizer_file: Path):
    cfg = run_config(arch, *overrides)
    model = perturbed_model(cfg)
    ckpt = write_checkpoint(root / "run", cfg, model, tokenizer_file)
    return cfg, model, export_checkpoint(ckpt, root / "export")


@pytest.mark.parametrize("arch,overrides", LOWRANK_CASES, ids=LOWRANK_IDS)
def test_lowrank_export_is_a_remote_code_model_with_our_logits(
    tmp_path: Path, tokenizer_file: Path, arch: str, overrides: list[tuple[str, str]]
) -> None:
    cfg, model, out = _export(tmp_path, arch, overrides, tokenizer_file)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"boostlr_{arch}"
    assert config["architectures"] == [f"Boostlr{arch.capitalize()}ForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    for name in REMOTE_CODE_FILES:  # the package's module, byte for byte
        assert (out / name).read_bytes() == (HF_DIR / name).read_bytes()

    hf = load_remote(out)
    # Built from the export's own copy of the modeling file, not from boostlr.
    assert type(hf).__module__.startswith("transformers_modules")
    assert type(hf).__name__ == config["architectures"][0]
    if cfg.model.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = random_tokens()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = model(tokens)
    assert theirs.dtype == torch.float32
    # transformers' sdpa runs boostlr's own attention call: the logits are boostlr's, bit for
    # bit (the attention-interface path is for other implementations: vLLM's).
    assert hf.config._attn_implementation == "sdpa"
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("arch,overrides", LOWRANK_CASES, ids=LOWRANK_IDS)
def test_generate_with_kv_cache_matches_boostlr_greedy(
    tmp_path: Path, tokenizer_file: Path, arch: str, overrides: list[tuple[str, str]]
) -> None:
    _, model, out = _export(tmp_path, arch, overrides, tokenizer_file)
    hf = load_remote(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = "alpha beta gamma delta"
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    new = 12
    with torch.no_grad():
        # No eos stop on either side, so both run the full length.
        cached = hf.generate(
            ids, max_new_tokens=new, do_sample=False, use_cache=True, eos_token_id=None
        )
        # One cached step against a full forward: the cache is really used, and right.
        step = hf(input_ids=cached[:, :-1], use_cache=True)
        cache = getattr(step, "cache", None) or getattr(step, "past_key_values", None)
        assert cache is not None and cache.get_seq_length() == cached.shape[1] - 1
        last = hf(input_ids=cached[:, -1:], **{_cache_arg(): cache}).logits[:, -1]
        full = model(cached)[:, -1]
    torch.testing.assert_close(last, full, atol=1e-5, rtol=0)
    assert cached.shape[1] == ids.shape[1] + new
    ours = ids
    with torch.no_grad():  # boostlr's model, greedy, recomputing the whole context each step
        for _ in range(new):
            ours = torch.cat([ours, model(ours)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert cached.tolist() == ours.tolist()


def test_left_padded_batch_generates_what_each_prompt_does_alone(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    _, _, out = _export(tmp_path, "lax", [("model.n_kv_heads", "2")], tokenizer_file)
    hf = load_remote(out)
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    tok.padding_side = "left"
    prompts = ["alpha beta gamma delta epsilon zeta", "kappa lambda"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert not bool(batch["attention_mask"].all())  # the second prompt is padded
    kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None}
    with torch.no_grad():
        together = hf.generate(**batch, **kwargs)
        for row, prompt in enumerate(prompts):
            alone = hf.generate(**tok(prompt, return_tensors="pt"), **kwargs)
            assert together[row, -6:].tolist() == alone[0, -6:].tolist()


@pytest.mark.parametrize("trust", [None, False])
def test_lowrank_export_without_remote_code_is_refused(
    tmp_path: Path, tokenizer_file: Path, trust: bool | None
) -> None:
    _, _, out = _export(tmp_path, "cola", [], tokenizer_file)
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(out, **kwargs)
    # Without the auto_map, transformers does not know the model type at all.
    config = json.loads((out / "config.json").read_text())
    del config["auto_map"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="boostlr_cola"):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("arch", ["full", "cola"])
def test_auto_tokenizer_encodes_what_tokenizers_encodes(
    tmp_path: Path, tokenizer_file: Path, arch: str
) -> None:
    _, _, out = _export(tmp_path, arch, [], tokenizer_file)
    config = json.loads((out / "config.json").read_text())
    if arch == "full":  # the dense export stays a plain LLaMA: no remote code
        assert config["model_type"] == "llama" and "auto_map" not in config
        assert not any((out / name).exists() for name in REMOTE_CODE_FILES)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    eos = eos_id(raw)
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TOKEN, eos)
    assert tok.bos_token_id == eos and tok.pad_token_id == eos
    assert config["eos_token_id"] == config["bos_token_id"] == eos
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special == {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    texts = [WORDS, "  alpha\n\n\tbeta  ", f"gamma{EOS_TOKEN}delta", "ünïcödé ✓ 数字"]
    for text in texts:
        ids = raw.encode(text).ids
        assert tok.encode(text) == ids, text
        assert tok(text)["input_ids"] == ids
        assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids)
    assert tok.decode(tok.encode(texts[1])) == texts[1]
    assert len(tok) == raw.get_vocab_size() <= VOCAB


def _cache_arg() -> str:
    fields = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    return "cache" if "cache" in fields else "past_key_values"
