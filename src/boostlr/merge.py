"""``boostlr export --merge-svd``: an svd model's factors multiplied into dense LLaMA weights.

An svd linear is ``B A x``, linear in ``x``, so ``W = B A`` (computed in float64, rounded once
to the checkpoint's dtype) is the same layer up to that rounding, and the model becomes a plain
``LlamaForCausalLM`` that any LLaMA runtime loads without remote code. CoLA and LaX put a SiLU
(LaX also a norm and the crossing) between the factors: no dense ``W`` equals them. The
merged MLP must be LLaMA's ``silu(gate) ⊙ up``; an svd model trained with
``model.mlp lowrank-only`` (``gate ⊙ up``, no activation) has no LLaMA form either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from boostlr.config import ModelConfig
from boostlr.errors import BoostlrError
from boostlr.specs.arch import FULL, arch_spec
from boostlr.stream_safetensors import TensorInfo

DOWN, UP = ".down.weight", ".up.weight"


def check_mergeable(cfg: ModelConfig) -> None:
    """Refuse, in one line, what has no dense LLaMA form."""
    arch = arch_spec(cfg.arch)
    if not arch.lowrank:
        raise BoostlrError(
            f"--merge-svd: arch {cfg.arch} is already dense: export without --merge-svd"
        )
    if not arch.mergeable:
        raise BoostlrError(
            f"--merge-svd: arch {cfg.arch} computes B silu(...A x) with a nonlinearity between "
            "its factors, so no dense weight equals it: export without --merge-svd (a "
            "transformers remote-code model)"
        )
    if cfg.mlp_form != "swiglu":
        raise BoostlrError(
            "--merge-svd: this svd model's MLP is gate * up with no activation (model.mlp "
            "lowrank-only, the svd default), which a LLaMA MLP (silu(gate) * up) cannot "
            "express: export without --merge-svd, or train the svd model with --model.mlp swiglu"
        )


def merged_config(cfg: ModelConfig) -> ModelConfig:
    """The dense model the merge writes: arch ``full``, SwiGLU, same shape."""
    return dataclasses.replace(cfg, arch=FULL.name, mlp="swiglu", rank=None)


def merged_tensors(
    infos: Mapping[str, TensorInfo], read: Callable[[str], torch.Tensor]
) -> tuple[dict[str, TensorInfo], Callable[[str], torch.Tensor]]:
    """Headers and a one-tensor-at-a-time reader of the merged state (our names).

    Each ``X.down.weight`` / ``X.up.weight`` pair becomes ``X.weight = up @ down``; every
    other tensor passes through. Reading one merged weight holds its two factors and the
    float64 product only, so the merge streams as the plain export does.
    """
    out: dict[str, TensorInfo] = {}
    factors: dict[str, str] = {}
    for name, info in infos.items():
        if name.endswith(UP):
            continue
        if name.endswith(DOWN):
            base = name.removesuffix(DOWN)
            up = infos[base + UP]
            out[base + ".weight"] = TensorInfo(info.dtype, (up.shape[0], info.shape[1]))
            factors[base + ".weight"] = base
        else:
            out[name] = info

    def read_merged(name: str) -> torch.Tensor:
        base = factors.get(name)
        if base is None:
            return read(name)
        down, up = read(base + DOWN), read(base + UP)
        return (up.double() @ down.double()).to(down.dtype)

    return out, read_merged
