"""Export checkpoints as Hugging Face model directories, and load models back for inference.

Our module names already match HF ``LlamaForCausalLM`` minus its ``model.`` prefix, so export
is a pure renaming, done one tensor at a time: a sharded checkpoint is consolidated with the
memory of its largest tensor, not of the model. An export directory holds
``model.safetensors`` (HF names), ``config.json`` (an HF config plus a ``"boostlr"`` section
with our model config), ``tokenizer.json`` with ``tokenizer_config.json`` and
``special_tokens_map.json``. ``arch = "full"`` is a plain ``LlamaForCausalLM``; a low-rank
arch keeps HF naming for its factors (``q_proj.down.weight`` / ``q_proj.up.weight``) and is a
remote-code model of its own ``model_type`` (the remote-code modules are copied in, see
:mod:`boostlr.hf`), so transformers loads it with ``trust_remote_code=True`` and refuses it
without. A mixture-of-experts model of any arch is a remote-code model too (an HF LLaMA has
no experts): its router, experts and balance bias keep boostlr's names. :func:`load_pretrained`
loads any of them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from boostlr.config import ModelConfig, RunConfig, model_config_from_dict, to_dict
from boostlr.data.tokenizer import load_tokenizer
from boostlr.errors import BoostlrError, CheckpointError
from boostlr.fsutil import replace_dir
from boostlr.hf.files import (
    copy_remote_code,
    llama_fields,
    lowrank_config,
    special_token_ids,
    write_tokenizer_files,
)
from boostlr.merge import check_mergeable, merged_config, merged_tensors
from boostlr.models.llama import LlamaModel, build_model
from boostlr.models.moe import zero_meta_buffers
from boostlr.rundir.checkpoint import load_model_state, open_checkpoint
from boostlr.rundir.layout import META_FILE, MODEL_FILE, TOKENIZER_FILE, checkpoints_dir
from boostlr.rundir.tensors import ModelTensors
from boostlr.stream_safetensors import write_safetensors

HF_CONFIG_FILE = "config.json"  # an export's HF config (a run's own config is config.toml)
LM_HEAD = "lm_head.weight"
HF_PREFIX = "model."


def hf_name(name: str) -> str:
    """Our name -> HF LLaMA name: everything but ``lm_head.weight`` moves under ``model.``."""
    return name if name == LM_HEAD else HF_PREFIX + name


def hf_state_dict(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`hf_name` applied to every key."""
    return {hf_name(k): v for k, v in model_state.items()}


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_dict`."""
    out = {}
    for name, tensor in hf_state.items():
        if name == LM_HEAD:
            out[name] = tensor
        elif name.startswith(HF_PREFIX):
            out[name.removeprefix(HF_PREFIX)] = tensor
        else:
            raise CheckpointError(
                f"unexpected tensor '{name}' in the export: re-export the checkpoint with "
                "boostlr export"
            )
    return out


def hf_config(
    model_cfg: ModelConfig, eos_token_id: int | None = None, bos_token_id: int | None = None
) -> dict[str, Any]:
    """HF ``config.json`` for ``model_cfg``, plus our config under ``"boostlr"``.

    A dense ``arch = "full"`` is an HF LLaMA config; a low-rank arch or an MoE model gets its
    own ``model_type`` and an ``auto_map`` to the remote-code files
    (:func:`boostlr.hf.files.lowrank_config`). The
    ``"boostlr"`` section is what :func:`load_pretrained` rebuilds the model from.
    """
    m = model_cfg
    if remote_code(m):
        tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
        return {**lowrank_config(m, tokens), "boostlr": _model_dict(m)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **llama_fields(m),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        # HF's defaults (bos 1, eos 2) are wrong for our tokenizers.
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "boostlr": _model_dict(m),
    }


def export_checkpoint(checkpoint: Path, out_dir: Path, merge_svd: bool = False) -> Path:
    """Write an HF-style export of ``checkpoint`` (step or run dir) to ``out_dir``, atomically.

    ``merge_svd`` writes an svd model as the dense LLaMA ``W = B A`` (:mod:`boostlr.merge`).
    An existing ``out_dir`` is replaced only if empty or an earlier export, so a typo cannot
    wipe unrelated files.
    """
    ckpt = open_checkpoint(Path(checkpoint))
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    cfg = _checkpoint_model_config(ckpt.meta, ckpt.path)
    if merge_svd:
        if cfg.moe_experts:
            raise BoostlrError(
                "--merge-svd: an MoE model has a router and experts, which a LLaMA has no "
                "place for: export without --merge-svd (a transformers remote-code model)"
            )
        check_mergeable(cfg)
    tokenizer_src = ckpt.path / TOKENIZER_FILE
    if not tokenizer_src.is_file():
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no {TOKENIZER_FILE}: export a checkpoint written by "
            "boostlr train"
        )
    source = ModelTensors(ckpt.path, ckpt.meta)
    infos, read = source.infos, source.read
    if merge_svd:
        infos, read = merged_tensors(infos, read)
        cfg = merged_config(cfg)
    # Our names by HF name; HF ties lm_head to embed_tokens itself.
    names = {hf_name(k): k for k in infos if not (cfg.tie_embeddings and k == LM_HEAD)}
    tokenizer = load_tokenizer(tokenizer_src)
    config = hf_config(cfg, **special_token_ids(tokenizer))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_safetensors(
            tmp / MODEL_FILE,
            {hf: infos[ours] for hf, ours in names.items()},
            lambda hf: read(names[hf]),
            metadata={"format": "pt"},
        )
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(tokenizer_src, tmp / TOKENIZER_FILE)
        write_tokenizer_files(tmp, tokenizer, cfg.max_seq_len)
        if remote_code(cfg):
            copy_remote_code(tmp, moe=cfg.moe_experts > 0)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_pretrained(path: Path, device: torch.device | str = "cpu") -> tuple[LlamaModel, Tokenizer]:
    """Model (eval mode) and tokenizer from a checkpoint (step or run dir) or an export dir."""
    path = Path(path)
    if is_export(path):
        cfg = export_model_config(path)
        state = from_hf_state_dict(load_file(path / MODEL_FILE))
        source = path
    elif (path / META_FILE).is_file() or checkpoints_dir(path).is_dir():
        ckpt = open_checkpoint(path)
        cfg = _checkpoint_model_config(ckpt.meta, ckpt.path)
        state = load_model_state(ckpt)
        source = ckpt.path
    else:
        raise BoostlrError(
            f"{path} is neither a checkpoint nor an export: pass runs/<run>, "
            "runs/<run>/checkpoints/step_N, or a directory written by boostlr export"
        )
    model = build_model(cfg, device="meta")
    if cfg.tie_embeddings:
        state.pop(LM_HEAD, None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise CheckpointError(
            f"weights in {source} do not fit its config ({first}): re-export or use another "
            "checkpoint"
        ) from None
    if cfg.tie_embeddings:
        missing = [k for k in missing if k != LM_HEAD]
        model.lm_head.weight = model.embed_tokens.weight
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {source} do not match its config (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): re-export or use another checkpoint"
        )
    zero_meta_buffers(model, "cpu")  # an MoE router's load counts (not saved)
    tokenizer = load_tokenizer(source / TOKENIZER_FILE)
    return model.to(device).eval(), tokenizer


def remote_code(m: ModelConfig) -> bool:
    """Whether the export is a remote-code model: low-rank factors or experts, which an HF
    LLaMA has neither of."""
    return m.lowrank or m.moe_experts > 0


def _model_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """``to_dict``-style model section (``None`` dropped), via a throwaway RunConfig."""
    return to_dict(RunConfig(model=model_cfg))["model"]


def _model_config(data: Any, source: Path) -> ModelConfig:
    if not isinstance(data, dict):
        raise CheckpointError(f"{source} has no model config: re-export or re-save it")
    return model_config_from_dict(data)


def export_model_config(path: Path) -> ModelConfig:
    """The model config of an export directory (its ``config.json``'s ``boostlr`` section)."""
    config = json.loads((Path(path) / HF_CONFIG_FILE).read_text())
    return _model_config(config.get("boostlr"), Path(path) / HF_CONFIG_FILE)


def _checkpoint_model_config(meta: dict[str, Any], source: Path) -> ModelConfig:
    return _model_config(meta.get("config", {}).get("model"), source / META_FILE)


def is_export(path: Path) -> bool:
    """An export dir: ``config.json`` with a ``"boostlr"`` section, next to the weights."""
    if not (path / HF_CONFIG_FILE).is_file() or not (path / MODEL_FILE).is_file():
        return False
    try:
        return "boostlr" in json.loads((path / HF_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False


def _check_out_dir(out_dir: Path) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise BoostlrError(f"--out {out_dir} is a file: pass a new directory for --out")
    if any(out_dir.iterdir()) and not is_export(out_dir):
        raise BoostlrError(
            f"--out {out_dir} is not empty and not an earlier export: pass a new --out directory"
        )
