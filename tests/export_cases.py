"""Shared by the export tests: a tiny tokenizer, perturbed tiny models and their checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from boostlr.config import RunConfig, build_config, to_dict
from boostlr.data.tokenizer import train_bpe
from boostlr.models.llama import LlamaModel, build_model
from boostlr.rundir.writer import CheckpointWriter

VOCAB = 320
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def write_tokenizer(path: Path) -> Path:
    """A byte-level BPE of ``VOCAB`` trained on permutations of ``WORDS``."""
    words = WORDS.split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(30)) for i in range(50)]
    train_bpe(docs, VOCAB).save(str(path))
    return path


def run_config(arch: str, *overrides: tuple[str, str]) -> RunConfig:
    cfg = build_config(overrides=[("model.preset", "tiny"), ("model.arch", arch), *overrides])
    cfg.model.vocab_size = VOCAB
    return cfg


def perturbed_model(cfg: RunConfig, seed: int = 0) -> LlamaModel:
    """A tiny model with every parameter perturbed, so norms and zero-init LaX gates matter."""
    model = build_model(cfg.model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def write_checkpoint(root: Path, cfg: RunConfig, model: LlamaModel, tokenizer_file: Path) -> Path:
    """A checkpoint laid out as the trainer writes it (tied ``lm_head`` not stored)."""
    state = model.state_dict()
    if cfg.model.tie_embeddings:
        state.pop("lm_head.weight")
    writer = CheckpointWriter(root / "checkpoints", rank=0, group=None, keep=3)
    writer.save(
        5,
        {"model": state},
        trainer={"step": 5},
        rng={"cpu": torch.get_rng_state()},
        meta={"config": {"model": to_dict(cfg)["model"]}},
        extra_files={"tokenizer.json": tokenizer_file},
    )
    return writer.wait()


def random_tokens(n: int = 24, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(3))


def prepare_words(root: Path, tokenizer_file: Path) -> Path:
    """Text in the tokenizer's words, prepared with it under ``root`` (so a run can train on
    it after an import)."""
    from boostlr.data import prepare_dataset

    words = WORDS.split()
    docs = [" ".join(words[(i * 5 + j * 3) % len(words)] for j in range(40)) for i in range(60)]
    text = root / "words.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_dataset([text], root / "data", tokenizer=str(tokenizer_file), progress=False)
    return root / "data"


def load_remote(out: Path):
    """An export loaded by transformers as its remote code, every weight accounted for."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()
