"""``boostlr import-hf``: a Hugging Face LLaMA directory becomes a boostlr run directory.

The result is what ``boostlr train`` would have written at step 0: ``config.toml``,
``tokenizer.json`` and one checkpoint ``checkpoints/step_0/`` (written by
:class:`~boostlr.rundir.writer.CheckpointWriter`, with zero AdamW moments for every
parameter and a fresh data position), so ``train --resume``, ``export``, ``eval`` and
``generate`` take it as they take any run.

``arch = full`` copies the weights (HF names minus ``model.`` are ours). A low-rank arch gets
each dense block weight ``W = U Σ Vᵀ`` as its truncated SVD: ``A = Σ_r^{1/2} V_rᵀ`` (``down``)
and ``B = U_r Σ_r^{1/2}`` (``up``), so ``B A`` is the best rank-r approximation of ``W``
(Eckart–Young); the relative error ``‖W − B A‖_F / ‖W‖_F`` of every linear is reported. For
``svd`` (``B A x``) that is the whole story. CoLA computes ``B σ(A x)`` with σ = SiLU between
the factors, so the same factors give a layer that is *not* ``W x`` even at full rank (SiLU is
far from the identity); the errors reported are those of ``B A`` only, and the imported CoLA
model is a warm start that needs training to recover. The MLP keeps the dense model's SwiGLU
(``model.mlp = swiglu``) unless ``--model.mlp`` says otherwise.

boostlr's own low-rank exports (``model_type boostlr_<arch>``, see :mod:`boostlr.hf`) come
back as they are: the model config is the export's ``"boostlr"`` section and the factors are
copied, not refactorised, so an export -> import round trip continues the same model. That
holds for their MoE exports too (router, experts and the balance bias, which the checkpoint
keeps beside the parameters as the trainer's does); a LLaMA has no experts to import into.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from boostlr.config import RunConfig, build_config, dump_toml
from boostlr.config.validate_moe import refuse_moe
from boostlr.data import TokenDataset, load_tokenizer
from boostlr.errors import BoostlrError, CheckpointError, ConfigError
from boostlr.export import LM_HEAD, from_hf_state_dict
from boostlr.fsutil import replace_dir
from boostlr.models.llama import ATTN_LINEARS, LlamaModel
from boostlr.models.moe import checkpointed_buffers, zero_meta_buffers
from boostlr.rundir.layout import CONFIG_FILE, TOKENIZER_FILE, checkpoints_dir
from boostlr.rundir.payload import checkpoint_payload
from boostlr.rundir.writer import CheckpointWriter
from boostlr.train.optim import build_optimizer, init_optimizer_state

IMPORT_FILE = "import.json"
HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"
IMPORT_ARCHS = ("full", "svd", "cola")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fixed by the HF model: an override would not fit the weights.
SHAPE_KEYS = (
    "model.preset",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_dim",
    "model.vocab_size",
    "model.rope_theta",
    "model.norm_eps",
    "model.tie_embeddings",
)


@dataclass
class ImportResult:
    run_dir: Path
    cfg: RunConfig
    errors: dict[str, float]  # "layers.{i}.{self_attn|mlp}.{linear}" -> relative error


# ---------------------------------------------------------------------------- reading HF


def hf_model_overrides(src: Path) -> list[tuple[str, str]]:
    """Our ``model.*`` keys from an HF LLaMA ``config.json`` (refusing what we cannot run)."""
    file = src / HF_CONFIG
    if not file.is_file():
        raise CheckpointError(f"{src} has no {HF_CONFIG}: pass a Hugging Face LLaMA directory")
    try:
        hf = json.loads(file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}): re-download it") from None
    if hf.get("model_type") != "llama":
        raise CheckpointError(
            f"{file}: model_type {hf.get('model_type')!r} is not 'llama': only LLaMA "
            "checkpoints can be imported"
        )
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported["rope type"] = (rope.get("rope_type", rope.get("type", "default")), "default")
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise CheckpointError(
                f"{file}: {key} {value!r} is not supported (boostlr's LLaMA needs {wanted!r})"
            )
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        values = {
            "model.dim": dim,
            "model.n_layers": int(hf["num_hidden_layers"]),
            "model.n_heads": heads,
            "model.n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "model.ffn_dim": int(hf["intermediate_size"]),
            "model.vocab_size": int(hf["vocab_size"]),
            "model.rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "model.max_seq_len": int(hf.get("max_position_embeddings", 4096)),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: missing or bad field {exc}: not a LLaMA config") from None
    if hf.get("head_dim") not in (None, dim // heads):
        raise CheckpointError(
            f"{file}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads: not supported"
        )
    return [(k, str(v).lower() if isinstance(v, bool) else repr(v)) for k, v in values.items()]


def read_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files, in our names, as float32."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{src} has no *.safetensors weights: save the model with "
            "save_pretrained(safe_serialization=True) (pytorch_model.bin is not read)"
        )
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        hf.update(load_file(file))
    hf = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    return {k: v.float() for k, v in from_hf_state_dict(hf).items()}


# ---------------------------------------------------------------------------- factorising


def svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A, B, ‖W − B A‖_F / ‖W‖_F)`` of the rank-r truncated SVD of ``W [d_out, d_in]``.

    Computed in float64; the factors are returned as float32 and the error is that of the
    float32 factors the model will hold.
    """
    w = weight.double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:rank].sqrt()
    down = (root[:, None] * vh[:rank]).float()  # A [r, d_in]
    up = (u[:, :rank] * root[None, :]).float()  # B [d_out, r]
    norm = torch.linalg.matrix_norm(w)
    error = torch.linalg.matrix_norm(w - up.double() @ down.double()) / norm if norm > 0 else 0.0
    return down, up, float(error)


def lowrank_state(
    dense: dict[str, torch.Tensor], cfg: RunConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Replace each block linear's ``weight`` by its SVD factors ``down`` / ``up``."""
    out, errors = dict(dense), {}
    for layer in range(cfg.model.n_layers):
        for name in LINEARS:
            owner = "self_attn" if name in ATTN_LINEARS else "mlp"
            prefix = f"layers.{layer}.{owner}.{name}"
            weight = out.pop(f"{prefix}.weight", None)
            if weight is None:
                raise CheckpointError(f"the weights have no {prefix}: not a LLaMA checkpoint")
            down, up, errors[prefix] = svd_factors(weight, cfg.model.rank)
            out[f"{prefix}.down.weight"], out[f"{prefix}.up.weight"] = down, up
    return out, errors


# ---------------------------------------------------------------------------- the run dir


def exported_model(src: Path) -> dict[str, Any] | None:
    """The ``"boostlr"`` model section of a low-rank boostlr export, else ``None``."""
    file = src / HF_CONFIG
    try:
        hf = json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # hf_model_overrides reports it
    if not str(hf.get("model_type", "")).startswith("boostlr_"):
        return None
    section = hf.get("boostlr")
    if not isinstance(section, dict):
        raise CheckpointError(
            f'{file}: model_type {hf["model_type"]!r} without a "boostlr" section: '
            "re-export the checkpoint with boostlr export"
        )
    return section


def export_config(
    src: Path, section: dict[str, Any], overrides: list[tuple[str, str]]
) -> RunConfig:
    """The run config of a boostlr export: its model section, then the user's overrides."""
    for key, _ in overrides:
        if key.startswith("model."):
            raise ConfigError(
                f"--{key}: {src} is a boostlr export whose model is fixed by its config.json; "
                "import it without --model.* (or export the run again)"
            )
    model = [
        (f"model.{key}", str(value).lower() if isinstance(value, bool) else str(value))
        for key, value in section.items()
    ]
    return build_config(overrides=[*model, *overrides])


def import_config(src: Path, overrides: list[tuple[str, str]]) -> RunConfig:
    """The run config: the HF shape, ``mlp = swiglu``, then the user's overrides."""
    for key, _ in overrides:
        if key in SHAPE_KEYS:
            raise ConfigError(
                f"--{key} is fixed by {src / HF_CONFIG}: import-hf takes the model's shape "
                "from it (override model.arch, model.rank, model.rank_ratio, model.mlp)"
            )
    cfg = build_config(overrides=[("model.mlp", "swiglu"), *hf_model_overrides(src), *overrides])
    if cfg.model.arch not in IMPORT_ARCHS:
        raise ConfigError(
            f"import-hf --model.arch {cfg.model.arch}: choose one of {', '.join(IMPORT_ARCHS)} "
            "(a LaX model has no dense counterpart to factorise)"
        )
    refuse_moe(cfg.model, "boostlr import-hf", "a dense HF MLP has no experts to import into")
    return cfg


def check_dataset(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """A ``--data.path`` must be tokenized with the imported model's tokenizer."""
    if cfg.data.path is None:
        return
    dataset = TokenDataset(cfg.data.path, "train")
    data_tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    if data_tok.get_vocab(with_added_tokens=True) != tokenizer.get_vocab(with_added_tokens=True):
        raise ConfigError(
            f"--data.path {cfg.data.path} was tokenized with another tokenizer than the "
            "model's: prepare it with boostlr prepare --tokenizer DIR/tokenizer.json"
        )
    if dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"--data.path {cfg.data.path} has vocabulary {dataset.vocab_size}, more than the "
            f"model's {cfg.model.vocab_size}"
        )


def build_imported_model(cfg: RunConfig, state: dict[str, torch.Tensor]) -> LlamaModel:
    model = LlamaModel(cfg.model, device="meta")
    if cfg.model.tie_embeddings:
        state.pop(LM_HEAD, None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise CheckpointError(f"the weights do not fit config.json ({first})") from None
    if cfg.model.tie_embeddings:
        missing = [k for k in missing if k != LM_HEAD]
        model.lm_head.weight = model.embed_tokens.weight
    if missing or unexpected:
        raise CheckpointError(
            f"the weights do not match config.json (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): not a LLaMA checkpoint"
        )
    zero_meta_buffers(model, "cpu")  # an MoE router's load counts (not saved)
    return model


def import_hf(src: Path, out: Path, overrides: list[tuple[str, str]] | None = None) -> ImportResult:
    """Write the run directory ``out`` (atomically: a temp dir renamed into place)."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory: pass a Hugging Face LLaMA directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BoostlrError(f"--out {out} exists and is not empty: pass a new run directory")
    section = exported_model(src)
    if section is None:
        cfg = import_config(src, overrides or [])
    else:
        cfg = export_config(src, section, overrides or [])
    tok_file = src / HF_TOKENIZER
    if not tok_file.is_file():
        raise CheckpointError(
            f"{src} has no {HF_TOKENIZER}: add the model's fast tokenizer (AutoTokenizer "
            "save_pretrained writes it) before importing"
        )
    tokenizer = load_tokenizer(tok_file)
    check_dataset(cfg, tokenizer)
    state = read_hf_weights(src)
    errors: dict[str, float] = {}
    if cfg.model.lowrank and section is None:
        state, errors = lowrank_state(state, cfg)
    model = build_imported_model(cfg, state)

    # A step-0 checkpoint like the trainer's: zero AdamW moments for every parameter, the
    # data at its start, no schedule anchor.
    optimizer = build_optimizer(model.parameters(), cfg.train)
    init_optimizer_state(optimizer)
    torch.manual_seed(cfg.train.seed)
    info = import_info(src, cfg, errors)
    start = {"epoch": 0, "windows": 0, "position": 0}
    payload = checkpoint_payload(
        cfg,
        list(model.named_parameters()),
        optimizer,
        0,
        start,
        None,
        {"import": info},
        buffers=checkpointed_buffers(model),
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shutil.copyfile(tok_file, tmp / TOKENIZER_FILE)
        (tmp / CONFIG_FILE).write_text(dump_toml(cfg))
        (tmp / IMPORT_FILE).write_text(json.dumps(info, indent=2) + "\n")
        writer = CheckpointWriter(checkpoints_dir(tmp), 0, None, cfg.train.keep_checkpoints)
        writer.save(0, *payload, {TOKENIZER_FILE: tmp / TOKENIZER_FILE})
        writer.close()
        replace_dir(tmp, out)  # ``out`` is absent or empty (checked above)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ImportResult(out, cfg, errors)


def import_info(src: Path, cfg: RunConfig, errors: dict[str, float]) -> dict[str, Any]:
    """What ``import.json`` and the checkpoint's ``meta.json["import"]`` record."""
    values = list(errors.values())
    return {
        "source": str(src.resolve()),
        "arch": cfg.model.arch,
        "rank": cfg.model.rank if cfg.model.lowrank else None,
        "method": "truncated SVD: A = S_r^1/2 V_r^T, B = U_r S_r^1/2" if errors else "copy",
        "reconstruction_error": errors,
        "max_error": max(values) if values else 0.0,
        "mean_error": sum(values) / len(values) if values else 0.0,
    }


def error_table(errors: dict[str, float], n_layers: int) -> list[list[str]]:
    """Rows ``[layer, q, k, v, o, gate, up, down]`` of relative errors, as text."""
    rows = []
    for layer in range(n_layers):
        row = [str(layer)]
        for name in LINEARS:
            owner = "self_attn" if name in ATTN_LINEARS else "mlp"
            value = errors[f"layers.{layer}.{owner}.{name}"]
            row.append(f"{value:.4f}" if math.isfinite(value) else str(value))
        rows.append(row)
    return rows
