"""What an export writes besides the weights: HF config, tokenizer files, remote code.

A low-rank or MoE export is a transformers remote-code model: ``config.json`` names its own
``model_type`` (``boostlr_<arch>``) and an ``auto_map`` pointing at the module files copied
beside it. Every export, dense included, gets ``tokenizer_config.json`` and
``special_tokens_map.json`` so ``AutoTokenizer`` knows the end-of-text token: without them
it has no eos/bos and lm-evaluation-harness fails on the first rolling loglikelihood.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from boostlr.config import ModelConfig
from boostlr.config.validate_moe import moe_dispatch_of
from boostlr.data.tokenizer import eos_id
from boostlr.hf import (
    CONFIG_MODULE,
    HF_DIR,
    MODELING_MODULE,
    MOE_MODULE,
    MOE_REMOTE_CODE_FILES,
    REMOTE_CODE_FILES,
)

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# A begin-of-text token when the vocabulary has one; else the end-of-text token serves, as in
# GPT-2: boostlr's token stream puts EOS before every document but the first.
_BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>")


def class_prefix(arch: str) -> str:
    """``cola`` -> ``BoostlrCola``: the class names of each arch in the remote-code files."""
    return "Boostlr" + arch.capitalize()


def model_class(m: ModelConfig) -> tuple[str, str]:
    """``(module, class)`` of the remote-code model: ``BoostlrColaForCausalLM`` in
    ``modeling_boostlr``, or an MoE model's ``BoostlrColaMoeForCausalLM`` in its own module."""
    prefix = class_prefix(m.arch)
    if m.moe_experts:
        return MOE_MODULE, f"{prefix}MoeForCausalLM"
    return MODELING_MODULE, f"{prefix}ForCausalLM"


def base_model_class(m: ModelConfig) -> str:
    """The remote-code base model (no head: ``AutoModel``, what vLLM's Transformers backend
    builds): ``BoostlrColaModel``, or ``BoostlrColaMoeModel`` beside the MoE causal LM."""
    prefix = class_prefix(m.arch)
    return f"{prefix}MoeModel" if m.moe_experts else f"{prefix}Model"


def config_class(m: ModelConfig) -> str:
    """The remote-code config class: an MoE model of a low-rank arch has its own
    (``BoostlrColaMoeConfig``), so transformers never maps it to the dense model class."""
    prefix = class_prefix(m.arch)
    return f"{prefix}MoeConfig" if m.moe_experts and m.lowrank else f"{prefix}Config"


def llama_fields(m: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields every export shares with an HF LLaMA config."""
    return {
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": m.tie_embeddings,
    }


def lowrank_config(m: ModelConfig, tokens: dict[str, int]) -> dict[str, Any]:
    """``config.json`` of a remote-code export (low-rank, or MoE of any arch): HF field
    names, our extra fields, ``auto_map``; the ``moe_*`` fields only for an MoE model, so a
    dense model's file is what it was before MoE existed."""
    module, model = model_class(m)
    factors = {"rank": m.rank} if m.lowrank else {}
    crossing = {"lax_gate": m.lax_gate, "lax_gate_rank": m.lax_gate_rank} if m.lowrank else {}
    config = {
        "architectures": [model],
        "model_type": f"boostlr_{m.arch}",
        "auto_map": {
            "AutoConfig": f"{CONFIG_MODULE}.{config_class(m)}",
            "AutoModel": f"{module}.{base_model_class(m)}",
            "AutoModelForCausalLM": f"{module}.{model}",
        },
        **llama_fields(m),
        **factors,
        "mlp_form": m.mlp_form,
        **crossing,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": tokens["bos_token_id"],
        "eos_token_id": tokens["eos_token_id"],
    }
    return config if m.moe_experts == 0 else {**config, **moe_fields(m)}


def moe_fields(m: ModelConfig) -> dict[str, Any]:
    """What the remote code's MoE MLP needs (the dispatch resolved); the training-only keys
    (``moe_aux_coef``, ``moe_bias_rate``) stay in the ``"boostlr"`` section alone."""
    return {
        "moe_experts": m.moe_experts,
        "moe_top_k": m.moe_top_k,
        "moe_shared": m.moe_shared,
        "moe_ffn_dim": m.moe_ffn_dim,
        "moe_dense_layers": m.moe_dense_layers,
        "moe_dispatch": moe_dispatch_of(m),
        "moe_balance": m.moe_balance,
        "moe_capacity": m.moe_capacity,
    }


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """``eos_token``, ``bos_token`` and ``pad_token`` (= eos: causal padding is masked)."""
    eos = tokenizer.id_to_token(eos_id(tokenizer))
    bos = next((t for t in _BOS_TOKENS if tokenizer.token_to_id(t) is not None), eos)
    return {"bos_token": bos, "eos_token": eos, "pad_token": eos}


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    names = special_tokens(tokenizer)
    return {
        "bos_token_id": tokenizer.token_to_id(names["bos_token"]),
        "eos_token_id": tokenizer.token_to_id(names["eos_token"]),
    }


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_seq_len: int) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for ``tokenizer.json``.

    ``PreTrainedTokenizerFast`` wraps ``tokenizer.json`` as it is, so ``AutoTokenizer``
    encodes exactly what ``tokenizers`` does; no BOS/EOS is added beyond the tokenizer's
    own post-processor, and decoding does not "clean up" spaces (that would change text).
    """
    names = special_tokens(tokenizer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # No token_type_ids: a causal LM takes none (transformers 4.x generate() refuses them).
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(names, indent=2) + "\n")


def copy_remote_code(out: Path, moe: bool = False) -> None:
    """The configuration and modeling modules (and ``moe``'s), byte for byte, beside the
    weights."""
    for name in MOE_REMOTE_CODE_FILES if moe else REMOTE_CODE_FILES:
        shutil.copyfile(HF_DIR / name, out / name)
