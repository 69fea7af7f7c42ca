"""boostlr exports served by vLLM: every arch and MoE form, fp32 and bf16, and at TP 2.

Each export runs in a real vLLM engine in its own process (``vllm_case.py``): a dense export
on vLLM's own LLaMA code, a low-rank or MoE export on its Transformers backend through the
export's remote code. Three prompts of different lengths are served as one batch, greedily.
In fp32 the text equals ``boostlr generate --temperature 0``'s, and every listed
log-probability is as close to float64's as transformers' fp32 is (``NOISE_FACTOR`` times its
error: tests/fp32_noise.py). In bf16 the log-probabilities are within ``BF16_FACTOR`` times
transformers' own bf16 error (tokens may part where bf16 ties). At TP 2 (the export's
``base_model_tp_plan``) the tokens equal TP 1's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_cases import write_tokenizer
from fp32_noise import BF16_FACTOR, NOISE_FACTOR, NOISE_FLOOR
from serve_cases import (
    DENSE_FIRST,
    HEAD32,
    MOE,
    boostlr_texts,
    export_case,
    logprob_errors,
    serve,
    served_texts,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SHARED_DENSE_FIRST = [*HEAD32, *MOE, *DENSE_FIRST, ("model.moe_shared", "1")]
CASES = {
    "full": ("full", HEAD32),
    "svd-mha": ("svd", [("model.n_heads", "2")]),
    "cola-gqa": ("cola", HEAD32),
    "lax-gqa-tied": ("lax", [*HEAD32, ("model.tie_embeddings", "true")]),
    "cola-moe-latent-shared-dense1": ("cola", SHARED_DENSE_FIRST),
    "full-moe-hidden-shared-dense1": ("full", SHARED_DENSE_FIRST),
    "lax-moe-latent-aux": ("lax", [*HEAD32, *MOE, ("model.moe_balance", "aux")]),
    "svd-moe-hidden": ("svd", [*HEAD32, *MOE, ("model.moe_dispatch", "hidden")]),
}
BF16_CASES = ["full", "svd-mha", "cola-gqa", "lax-gqa-tied", "cola-moe-latent-shared-dense1"]
# TP 2 needs heads and kv heads divisible by 2: d 128, 4 heads of 32, 2 kv heads.
TP_SHAPE = [("model.dim", "128"), ("model.n_heads", "4"), ("model.n_kv_heads", "2")]
TP_CASES = {
    "cola": ("cola", TP_SHAPE),
    "lax-moe-latent-dense1": ("lax", [*TP_SHAPE, *MOE, *DENSE_FIRST]),
    "full-moe-hidden": ("full", [*TP_SHAPE, *MOE]),
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_export_serves_boostlr_generates_tokens(
    case: str, tmp_path: Path, tokenizer_file: Path
) -> None:
    arch, overrides = CASES[case]
    export = export_case(tmp_path, arch, overrides, tokenizer_file)
    results = serve(export, tmp_path / "vllm.json")
    assert all(r["token_ids"] for r in results)
    assert served_texts(export, results) == boostlr_texts(export)
    served, noise = logprob_errors(export, results, torch.float32)
    assert noise < 1e-4, noise  # transformers' fp32 against float64: rounding only
    assert served <= NOISE_FACTOR * max(noise, NOISE_FLOOR), (served, noise)


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_export_serves_within_bf16_noise(
    case: str, tmp_path: Path, tokenizer_file: Path
) -> None:
    arch, overrides = CASES[case]
    export = export_case(tmp_path, arch, overrides, tokenizer_file)
    config = json.loads((export / "config.json").read_text())
    assert config["torch_dtype"] == "float32"  # served in bf16 by vLLM's --dtype alone
    results = serve(export, tmp_path / "vllm.json", dtype="bfloat16")
    assert all(r["token_ids"] for r in results)
    served, noise = logprob_errors(export, results, torch.bfloat16)
    assert 1e-4 < noise < 0.1, noise  # transformers' bf16 against float64: really bf16
    assert served <= BF16_FACTOR * noise, (served, noise)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_serves_the_tokens_of_tp1(case: str, tmp_path: Path, tokenizer_file: Path) -> None:
    arch, overrides = TP_CASES[case]
    export = export_case(tmp_path, arch, overrides, tokenizer_file)
    one = serve(export, tmp_path / "tp1.json")
    two = serve(export, tmp_path / "tp2.json", tp=2)
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert served_texts(export, one) == boostlr_texts(export)
    served, noise = logprob_errors(export, two, torch.float32)
    assert served <= NOISE_FACTOR * max(noise, NOISE_FLOOR), (served, noise)
