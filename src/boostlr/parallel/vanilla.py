"""Vanilla (naive) tensor parallelism for low-rank models: the baseline BOOST beats.

Every low-rank pair is its own Megatron region: A column-parallel (rank split), σ local,
B row-parallel (rank split) and an all-reduce of ``[T, d_out]`` after *every* low-rank
linear. Norms, attention and MLP products run on replicated activations. LaX's latent
crossing needs the whole rank, so its latent is all-gathered (``[T, r]``) before the
crossing and re-split before B.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from boostlr.models.llama import Block, Latents, causal_attention
from boostlr.models.lowrank import LaxLinear, LowRankLinear
from boostlr.models.mlp import GATED, gated
from boostlr.models.params import local
from boostlr.parallel import megatron
from boostlr.parallel.collectives import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from boostlr.parallel.context import TPContext, wire
from boostlr.specs.strategy import VANILLA

SPEC = VANILLA
#: The MLP kinds :func:`block_forward` runs.
MLP_KINDS = (GATED,)

# The dense parts (embedding, LM head, loss) are Megatron's vocab-parallel ones.
embed = megatron.embed
head_input = megatron.head_input


def lowrank_linear(
    lin: LowRankLinear, x: Tensor, z_prev: Tensor | None, ctx: TPContext, tag: str
) -> tuple[Tensor, Tensor | None]:
    """``x`` must already be in the region (``copy_to_group``); returns the all-reduced ``y``."""
    a = F.linear(x, local(lin.down.weight))
    if isinstance(lin, LaxLinear):
        a_full = gather_from_group(a, ctx.comm, f"{tag}.latent")
        h_full, z = lin.latent(a_full, z_prev)
        h = scatter_to_group(wire(h_full), ctx.comm, f"{tag}.latent")
    else:
        h, z = lin.latent(a, None)
    return reduce_from_group(F.linear(h, local(lin.up.weight)), ctx.comm, tag), z


def block_forward(
    block: Block, x: Tensor, rope: tuple[Tensor, Tensor], z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents]:
    attn, mlp, comm = block.self_attn, gated(block.mlp, SPEC.name), ctx.comm
    zp = z_prev or {}
    z: Latents = {}
    h = copy_to_group(wire(block.input_layernorm(x)), comm, "attn_in")
    q, z["q_proj"] = lowrank_linear(attn.q_proj, h, zp.get("q_proj"), ctx, "q_proj")
    k, z["k_proj"] = lowrank_linear(attn.k_proj, h, zp.get("k_proj"), ctx, "k_proj")
    v, z["v_proj"] = lowrank_linear(attn.v_proj, h, zp.get("v_proj"), ctx, "v_proj")
    out = copy_to_group(wire(causal_attention(q, k, v, rope, attn.head_dim)), comm, "o_in")
    o, z["o_proj"] = lowrank_linear(attn.o_proj, out, zp.get("o_proj"), ctx, "o_proj")
    x = x + o
    h = copy_to_group(wire(block.post_attention_layernorm(x)), comm, "mlp_in")
    outs = []
    for name, lin in mlp.readers():
        out, z[name] = lowrank_linear(lin, h, zp.get(name), ctx, name)
        outs.append(out)
    prod = copy_to_group(wire(mlp.combine(*outs)), comm, "down_in")
    name, down = mlp.writer()
    d, z[name] = lowrank_linear(down, prod, zp.get(name), ctx, name)
    return x + d, z
