"""Remote code on transformers' attention interface, as vLLM's Transformers backend runs it.

vLLM builds an export's base model (``auto_map["AutoModel"]``) with its own attention
implementation registered in ``ALL_ATTENTION_FUNCTIONS`` and reads ``layer_idx``, ``config``
and ``scaling`` off each attention module. These tests register a real implementation
(transformers' own SDPA function, counting its calls) under a new name and load the export
with it: every block's attention goes through it once, with un-repeated KV heads, and the
logits stay boostlr's within fp32 noise. The tensor-parallel plan names only modules that
exist, with styles both transformers and vLLM know.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from export_cases import load_remote, perturbed_model, random_tokens, run_config, write_checkpoint
from export_cases import write_tokenizer as _write_tokenizer
from fp32_noise import difference_bound, relative_error

from boostlr.export import export_checkpoint

transformers = pytest.importorskip("transformers")
modeling_utils = pytest.importorskip("transformers.modeling_utils")
if not hasattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS"):
    pytest.skip("transformers has no attention interface", allow_module_level=True)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MOE = [("model.moe_experts", "4"), ("model.moe_top_k", "2"), ("model.moe_ffn_dim", "32")]
DENSE_FIRST = [("model.n_layers", "3"), ("model.moe_dense_layers", "1")]
CASES = {
    "cola-gqa": ("cola", [("model.n_kv_heads", "2")]),
    "lax-tied": ("lax", [("model.tie_embeddings", "true")]),
    "svd": ("svd", []),
    "full-moe-hidden-dense1": (
        "full",
        [*MOE, ("model.n_layers", "3"), ("model.moe_dense_layers", "1")],
    ),
    "cola-moe-latent-gqa": ("cola", [*MOE, ("model.n_kv_heads", "2")]),
}
# vLLM's replace_linear_class knows these; transformers' ParallelInterface registers both.
TP_STYLES = {"colwise", "rowwise"}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _export(root: Path, case: str, tokenizer_file: Path):
    arch, overrides = CASES[case]
    cfg = run_config(arch, *overrides)
    model = perturbed_model(cfg)
    ckpt = write_checkpoint(root / "run", cfg, model, tokenizer_file)
    return cfg, model, export_checkpoint(ckpt, root / "export")


class CountingSdpa:
    """transformers' SDPA attention function, recording who called it with what."""

    def __init__(self):
        self.calls: list[tuple[int, int, int, float]] = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((module.layer_idx, query.shape[1], key.shape[1], kwargs["scaling"]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture
def counting_sdpa():
    functions = modeling_utils.ALL_ATTENTION_FUNCTIONS
    fn = CountingSdpa()
    functions.register("boostlr_counting_sdpa", fn)
    yield fn
    functions._global_mapping.pop("boostlr_counting_sdpa", None)
    functions._local_mapping.pop("boostlr_counting_sdpa", None)


@pytest.mark.parametrize("case", list(CASES))
def test_attention_goes_through_the_interface_once_per_block(
    tmp_path: Path, tokenizer_file: Path, case: str, counting_sdpa: CountingSdpa
) -> None:
    cfg, model, out = _export(tmp_path, case, tokenizer_file)
    m = cfg.model
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, attn_implementation="boostlr_counting_sdpa"
    ).eval()
    tokens = random_tokens()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = model(tokens)
        exact = model.double()(tokens)
    scale = m.head_dim**-0.5
    assert counting_sdpa.calls == [(i, m.n_heads, m.n_kv_heads, scale) for i in range(m.n_layers)]
    noise = relative_error(ours, exact)
    assert relative_error(theirs, ours) <= difference_bound(noise)


@pytest.mark.parametrize("case", ["cola-gqa", "full-moe-hidden-dense1"])
def test_auto_model_is_the_arch_base_model_and_returns_tuples(
    tmp_path: Path, tokenizer_file: Path, case: str
) -> None:
    """What vLLM calls: ``AutoModel`` of the export, one flattened row, no cache, tuples."""
    _, _, out = _export(tmp_path, case, tokenizer_file)
    config = json.loads((out / "config.json").read_text())
    base = transformers.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(base).__name__ == config["auto_map"]["AutoModel"].rsplit(".", 1)[1]
    assert type(base).config_class.__name__ == config["auto_map"]["AutoConfig"].rsplit(".")[-1]
    full = load_remote(out)
    tokens = random_tokens(batch=1)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        hidden = base(input_ids=tokens, position_ids=positions, use_cache=False, return_dict=False)
        reference = full.model(input_ids=tokens).last_hidden_state
    assert isinstance(hidden, tuple) and len(hidden) == 1
    assert torch.equal(hidden[0], reference)


@pytest.mark.parametrize("case", ["lax-tied", "full-moe-hidden-dense1", "cola-moe-latent-gqa"])
def test_tp_plan_names_the_models_linears(tmp_path: Path, tokenizer_file: Path, case: str) -> None:
    """Every entry of ``base_model_tp_plan`` is a style both runtimes know and matches
    ``nn.Linear`` modules of the base model (vLLM splits only those), the attention of every
    block included."""
    cfg, _, out = _export(tmp_path, case, tokenizer_file)
    base = transformers.AutoModel.from_pretrained(out, trust_remote_code=True)
    plan = base.config.base_model_tp_plan
    assert plan and set(plan.values()) <= TP_STYLES
    linears = {n for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear)}
    matched = set()
    for pattern in plan:
        regex = re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")
        hits = {n for n in linears if regex.match(n)}
        # An MoE block's MLP is replicated (experts are not linears): a model whose every
        # block is MoE has nothing for the MLP entries.
        all_moe = cfg.model.moe_experts > 0 and cfg.model.moe_dense_layers == 0
        assert hits or (all_moe and ".mlp." in pattern), pattern
        matched |= hits
    # Heads and the MLP's f are split in every block that has them: q, k, v, o in each.
    for i in range(cfg.model.n_layers):
        assert any(n.startswith(f"layers.{i}.self_attn.o_proj") for n in matched), i
