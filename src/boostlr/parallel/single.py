"""The single-device model as a "strategy": TP degree 1, every parameter whole.

It lets :class:`~boostlr.parallel.tensor_parallel.TensorParallelModel` run the plain model
through the same loop as the sharded ones (whole-block checkpointing included) while the
math stays the model's own.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from boostlr.config import ModelConfig
from boostlr.models.llama import Block, Latents, LlamaModel
from boostlr.models.params import local
from boostlr.parallel.context import TPContext
from boostlr.parallel.sharding import REPLICATED, ShardSpec


def param_spec(name: str, cfg: ModelConfig, tp: int) -> ShardSpec:
    return REPLICATED


def embed(model: LlamaModel, tokens: Tensor, ctx: TPContext) -> Tensor:
    return F.embedding(tokens, local(model.embed_tokens.weight))


def block_forward(
    block: Block, x: Tensor, rope: tuple[Tensor, Tensor], z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents]:
    return block.compute(x, rope, z_prev)


def head_logits(model: LlamaModel, x: Tensor, ctx: TPContext) -> Tensor:
    return model.head(x)
