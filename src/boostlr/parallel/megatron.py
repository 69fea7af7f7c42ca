"""Megatron tensor parallelism for the dense (``full``) model.

q, k, v, gate, up are column-parallel (heads / MLP width split); o and down are row-parallel
and end in an all-reduce of ``[T, d]``; embedding, LM head and loss are vocab-parallel.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from boostlr.models.llama import Block, Latents, LlamaModel, causal_attention, mlp_product
from boostlr.models.params import local
from boostlr.parallel.collectives import copy_to_group, reduce_from_group
from boostlr.parallel.context import TPContext, wire
from boostlr.parallel.vocab import vocab_parallel_embedding


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
    attn, mlp, comm = block.self_attn, block.mlp, ctx.comm
    h = copy_to_group(wire(block.input_layernorm(x)), comm, "attn_in")
    q, k, v = (F.linear(h, local(getattr(attn, n).weight)) for n in ("q_proj", "k_proj", "v_proj"))
    out = causal_attention(q, k, v, rope, attn.head_dim)
    x = x + reduce_from_group(F.linear(out, local(attn.o_proj.weight)), comm, "o_proj")
    h = copy_to_group(wire(block.post_attention_layernorm(x)), comm, "mlp_in")
    gate, up = F.linear(h, local(mlp.gate_proj.weight)), F.linear(h, local(mlp.up_proj.weight))
    prod = mlp_product(gate, up, mlp.form)
    x = x + reduce_from_group(F.linear(prod, local(mlp.down_proj.weight)), comm, "down_proj")
    return x, None
