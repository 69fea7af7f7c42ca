"""The single-device model as a "strategy": TP degree 1, every parameter whole.

It lets :class:`~boostlr.parallel.tensor_parallel.TensorParallelModel` run the plain model
through the same loop as the sharded ones (whole-block checkpointing included). With
``grouping`` on (the default) a low-rank block runs BTP's block on one rank: the same code as
at TP > 1, so one device gets BOOST's grouped projections (``[A_q|A_k|A_v]`` and
``[A_gate|A_up]`` as one GEMM each, same-shaped B's as one batched GEMM) and every collective
is a no-op. ``grouping`` off (and the dense model, and an MLP kind other than gated: an MoE
block keeps its fp32 router here) runs the model's own
:meth:`~boostlr.models.llama.Block.compute`, the reference math.
"""

from __future__ import annotations

from torch import Tensor

from boostlr.models.llama import Block, Latents, LlamaModel
from boostlr.models.mlp import GATED
from boostlr.models.params import local
from boostlr.parallel import btp
from boostlr.parallel.context import TPContext
from boostlr.parallel.vocab import vocab_parallel_embedding

#: No strategy spec: the single-device model (``strategy=None``).
SPEC = None
#: Every MLP kind runs (through :meth:`~boostlr.models.llama.Block.compute` if need be).
MLP_KINDS = None


def embed(model: LlamaModel, tokens: Tensor, ctx: TPContext) -> Tensor:
    """Whole rows, split over dp only."""
    split = ctx.vocab_split(rows_over_tp=False)
    return vocab_parallel_embedding(tokens, local(model.embed_tokens.weight), split, ctx.vocab_dp)


def block_forward(
    block: Block, x: Tensor, rope: tuple[Tensor, Tensor], z_prev: Latents | None, ctx: TPContext
) -> tuple[Tensor, Latents]:
    if ctx.grouping and ctx.cfg.lowrank and block.mlp.kind == GATED:
        return btp.block_forward(block, x, rope, z_prev, ctx)
    return block.compute(x, rope, z_prev)


def head_input(model: LlamaModel, x: Tensor, ctx: TPContext) -> Tensor:
    """The final norm: what the LM head multiplies."""
    return model.norm(x)
