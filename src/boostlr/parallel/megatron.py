"""Megatron tensor parallelism for the dense (``full``) model.

q, k, v and the MLP's readers (gate, up) are column-parallel (heads / MLP width split); o and
the MLP's writer (down) are row-parallel and end in an all-reduce of ``[T, d]``; embedding, LM
head and loss are vocab-parallel. It runs the gated MLP only (:mod:`boostlr.models.mlp`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from boostlr.models.llama import Block, Latents, LlamaModel, causal_attention
from boostlr.models.mlp import GATED, gated
from boostlr.models.params import local
from boostlr.parallel.collectives import copy_to_group, reduce_from_group
from boostlr.parallel.context import TPContext, wire
from boostlr.parallel.vocab import vocab_parallel_embedding
from boostlr.specs.strategy import MEGATRON

SPEC = MEGATRON
#: The MLP kinds :func:`block_forward` runs.
MLP_KINDS = (GATED,)


def embed(model: LlamaModel, tokens: Tensor, ctx: TPContext) -> Tensor:
    return vocab_parallel_embedding(
        tokens, local(model.embed_tokens.weight), ctx.vocab_split(), ctx.vocab_dp, ctx.comm
    )


def head_input(model: LlamaModel, x: Tensor, ctx: TPContext) -> Tensor:
    """Final norm on the replicated stream; every rank multiplies it by its vocabulary slice."""
    return copy_to_group(wire(model.norm(x)), ctx.comm, "head_in")


def block_forward(
    block: Block, x: Tensor, rope: tuple[Tensor, Tensor], z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents | None]:
    attn, mlp, comm = block.self_attn, gated(block.mlp, SPEC.name), ctx.comm
    h = copy_to_group(wire(block.input_layernorm(x)), comm, "attn_in")
    q, k, v = (F.linear(h, local(getattr(attn, n).weight)) for n in ("q_proj", "k_proj", "v_proj"))
    out = causal_attention(q, k, v, rope, attn.head_dim)
    x = x + reduce_from_group(F.linear(out, local(attn.o_proj.weight)), comm, "o_proj")
    h = copy_to_group(wire(block.post_attention_layernorm(x)), comm, "mlp_in")
    prod = mlp.combine(*(F.linear(h, local(lin.weight)) for _, lin in mlp.readers()))
    name, down = mlp.writer()
    x = x + reduce_from_group(F.linear(prod, local(down.weight)), comm, name)
    return x, None
