"""One rank's tensor-parallel part of the model and its forward.

:class:`TensorParallelModel` keeps the single-device module tree (same parameter names),
each parameter being this rank's shard (:mod:`boostlr.parallel.build` makes them), and runs
the strategy's forward. Parameters keep their single-device names and (as DTensors) their
global shapes, so checkpoints are written and read by name at any layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from boostlr.config import ModelConfig
from boostlr.models.llama import LlamaModel, rope_tables
from boostlr.models.params import in_dtype, local
from boostlr.models.placement import shard_dim
from boostlr.models.shapes import crossing_latents
from boostlr.parallel.compile import compiled
from boostlr.parallel.context import TPContext, wire
from boostlr.parallel.head_loss import head_cross_entropy
from boostlr.parallel.sharding import ShardSpec
from boostlr.parallel.strategies import runtime_for
from boostlr.parallel.vocab import gather_batch, vocab_parallel_cross_entropy
from boostlr.specs.arch import arch_spec

LATENT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The residual stream's dtype, at every layout and under every ``train.dtype``.
RESIDUAL_DTYPE = torch.float32


def boundary_dtypes(cfg: ModelConfig, dtype: torch.dtype, layer: int) -> list[torch.dtype]:
    """What crosses the pipeline stage boundary into block ``layer``, in
    :meth:`TensorParallelModel.forward`'s order.

    The residual stays fp32 (docs/precision.md); LaX's latents that block reads
    (:func:`~boostlr.models.shapes.crossing_latents`: an MoE block takes no ``down_proj``
    latent) travel in the compute dtype ``dtype``: the next block only uses them as the input
    of its gate's GEMM, which rounds them to that dtype anyway, so one or two stages compute
    the same numbers. The sender (:func:`to_boundary`) and the receive buffers
    (:mod:`boostlr.parallel.pipeline`) both follow this list: a send and its receive must
    agree on dtype and shape (on NCCL a mismatch is not an error: it hangs or delivers
    garbage).
    """
    return [RESIDUAL_DTYPE] + [dtype] * len(crossing_latents(cfg, layer))


def to_boundary(outputs: tuple[Tensor, ...], dtypes: list[torch.dtype]) -> tuple[Tensor, ...]:
    """A stage's outputs as declared: each contiguous (p2p sends need it) in its dtype."""
    return tuple(in_dtype(t, dt).contiguous() for t, dt in zip(outputs, dtypes, strict=True))


class TensorParallelModel(nn.Module):
    """A sharded :class:`LlamaModel` (or one pipeline stage of it).

    ``strategy=None`` is the plain single-device model. ``model`` already holds this rank's
    shards: :mod:`boostlr.parallel.build` builds it on the meta device and materialises each
    shard by itself; at one rank a whole single-device model is its own shard.
    """

    def __init__(
        self,
        model: LlamaModel,
        strategy: str | None,
        ctx: TPContext,
    ):
        super().__init__()
        self.cfg = model.cfg
        self.ctx = ctx
        self.strategy = runtime_for(strategy, model)
        self.specs: dict[str, ShardSpec] = {
            name: ShardSpec(shard_dim(name, strategy, model.cfg.tie_embeddings))
            for name, _ in model.named_parameters()
        }
        self.model = model
        # LaX's latents cross from one block into the next: stage outputs carry them too.
        self.crossing = arch_spec(self.cfg.arch).crossing
        forward = self.strategy.block_forward
        self._block_forward = compiled(forward) if ctx.compile else forward
        held = [int(i) for i in model.layers]
        # The blocks around this stage's boundaries: the first it runs, the next stage's first.
        self._first_layer = min(held, default=0)
        self._next_layer = max(held, default=-1) + 1

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Tensor, targets: Tensor | None = None) -> Tensor | tuple:
        """Stage outputs; with ``targets`` (a whole model) the mean loss.

        The first stage takes tokens, a later one the residual (plus the LaX latents its first
        block reads, :func:`~boostlr.models.shapes.crossing_latents`); the last stage returns
        this rank's logits, or with ``targets`` its loss (how a pipeline's last stage runs:
        the head's logits never leave it), an earlier one ``(x, *latents)``.
        """
        s, ctx = self.strategy, self.ctx
        if self.model.first:
            tokens, *rest = inputs
            targets = rest[0] if rest else targets
            x = self.model.embed_tokens(tokens, impl=lambda _, t: s.embed(self.model, t, ctx))
            x = in_dtype(x, RESIDUAL_DTYPE)
            z = None
        else:
            x, *zs = inputs
            received = crossing_latents(self.cfg, self._first_layer)
            z = dict(zip(received, zs, strict=True)) if zs else None
        rope = rope_tables(self.cfg, x.shape[1], device=x.device)
        for index, block in self.model.layers.items():
            with torch.profiler.record_function(f"block.{index}"):
                x, z = block(x, rope, z, impl=self._block_impl)
        if not self.model.last:
            # The latents the next stage's first block reads (not an MoE block's down_proj).
            sent_names = crossing_latents(self.cfg, self._next_layer)
            outputs = (x, *(z[n] for n in sent_names)) if self.crossing else (x,)
            sent = to_boundary(outputs, boundary_dtypes(self.cfg, ctx.dtype, self._next_layer))
            return sent if self.crossing else sent[0]
        h = s.head_input(self.model, x, ctx)
        return self.model.lm_head(h, impl=lambda lm_head, h_: self._head(lm_head, h_, targets))

    def _head(self, lm_head: nn.Module, h: Tensor, targets: Tensor | None) -> Tensor:
        """This rank's logits, or with ``targets`` the loss (fused with the head GEMM).

        With the vocabulary split over dp the logits are those of every dp rank's tokens
        (``[dp * mb, s, rows]``) for this rank's rows, and the loss is their mean over the dp
        ranks' micro-batches.
        """
        head, ctx = local(lm_head.weight), self.ctx
        if ctx.vocab_dp_size > 1:
            h = gather_batch(wire(h), ctx.vocab_dp, "head_in")
        if targets is not None and ctx.fused_loss:
            targets = self._batch_targets(targets)
            split = ctx.vocab_split()
            return head_cross_entropy(h.flatten(0, 1), head, targets.flatten(), split)
        logits = F.linear(h, head)
        return logits if targets is None else self.loss(logits, targets)

    def _batch_targets(self, targets: Tensor) -> Tensor:
        """Every dp rank's targets when the vocabulary is split over dp, else ``targets``."""
        return gather_batch(targets, self.ctx.vocab_dp, "targets")

    def _block_impl(self, block, x, rope, z_prev):
        """The strategy's block, under whole-block checkpointing when ``act_ckpt=block``.

        LaX latents travel through the checkpoint as extra tensor inputs/outputs.
        """
        forward, ctx = self._block_forward, self.ctx
        if ctx.act_ckpt != "block":
            return forward(block, x, rope, z_prev, ctx)
        names = LATENT_NAMES if self.crossing else ()

        def run(x_: Tensor, *zs: Tensor):
            zp = dict(zip(names, zs, strict=True)) if zs else None
            out, z = forward(block, x_, rope, zp, ctx)
            return (out, *(z[n] for n in names))

        # A latent no block reads is None (an MoE block's down_proj) or absent (not received).
        zs = tuple(z_prev.get(n) for n in names) if z_prev else ()
        out, *z_out = ctx.checkpointed(run, x, *zs)
        return out, (dict(zip(names, z_out, strict=True)) if names else None)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean token cross-entropy of this rank's (vocabulary slice of the) logits.

        ``targets`` are this rank's; the logits are those :meth:`forward` returned (with the
        vocabulary split over dp, for every dp rank's tokens).
        """
        targets = self._batch_targets(targets)
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.ctx.vocab_split()
        )
