"""Exact per-step tensor-parallel communication of each strategy (docs/design.md §2–§3).

Each strategy's collectives per block, on a first and on a last stage are functions of the
shapes in its spec (:mod:`boostlr.specs.strategy`); this module sums them over a stage. They
mirror the collectives the strategies issue, call for call; the tests check
them against the communication ledger of real gloo runs, so they can be trusted for
planning runs that are too large to execute here. Counts are per rank and per micro-batch
(forward + backward, plus the checkpoint re-forward), as payload bytes and calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boostlr.config import ModelConfig, ParallelConfig
from boostlr.models.shapes import LINEARS, crossing_latents
from boostlr.specs.arch import arch_spec
from boostlr.specs.strategy import FP32, BlockShape, spec_or_none, strategy_spec


@dataclass(frozen=True)
class CommVolume:
    """Payload bytes and calls per phase for one rank and one micro-batch."""

    fwd: int
    bwd: int
    recompute: int
    calls_fwd: int
    calls_bwd: int
    calls_recompute: int

    @property
    def total(self) -> int:
        return self.fwd + self.bwd + self.recompute

    @property
    def calls(self) -> int:
        return self.calls_fwd + self.calls_bwd + self.calls_recompute

    def metrics(self, micro_batches: int = 1) -> dict[str, int]:
        """The ``comm_tp_*`` entries of a metrics row (a step has ``micro_batches``)."""
        n = micro_batches
        return {
            "comm_tp_bytes": self.total * n,
            "comm_tp_calls": self.calls * n,
            "comm_tp_bytes_fwd": self.fwd * n,
            "comm_tp_bytes_bwd": self.bwd * n,
            "comm_tp_bytes_recompute": self.recompute * n,
        }


def block_shape(cfg: ModelConfig, tokens: int, act_size: int = FP32) -> BlockShape:
    """The numbers a strategy's traffic depends on, for a micro-batch of ``tokens``."""
    crossing = arch_spec(cfg.arch).crossing
    return BlockShape(tokens, cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.rank or 0, act_size, crossing)


def tp_comm_volume(
    cfg: ModelConfig,
    strategy: str,
    tp: int,
    tokens: int,
    norm: str = "online",
    grouping: bool = True,
    act_ckpt: str = "none",
    act_size: int = FP32,
    first: bool = True,
    last: bool = True,
    vocab_dp: int = 1,
) -> CommVolume:
    """Per-step TP traffic of ``strategy`` for a micro-batch of ``tokens`` tokens.

    ``act_size`` is the bytes per element of activations in flight (2 under bf16 autocast).
    The residual-stream collectives (vocab-parallel embedding, BTP's last-hidden gather) and
    the loss statistics stay fp32, as the fp32 residual and master weights do. A pipeline
    stage holds ``cfg.n_layers`` blocks and the embedding only if ``first``, the final norm,
    head and loss only if ``last``. With the vocabulary split over ``vocab_dp`` data-parallel
    ranks too, the loss statistics cover every dp rank's tokens.
    """
    if tp == 1:
        return CommVolume(0, 0, 0, 0, 0, 0)
    spec = strategy_spec(strategy)
    embed = 1 if first else 0
    head = 1 if last else 0
    shape = block_shape(cfg, tokens, act_size)
    L = cfg.n_layers
    ce_fwd, ce_calls = 3 * tokens * vocab_dp * FP32, 3  # max, sum of exps, target logit: [T]
    block = spec.block_traffic(shape, grouping, norm)
    edge_in = spec.embedding_traffic(shape, cfg.tie_embeddings)
    edge_out = spec.last_traffic(shape)
    fwd = embed * edge_in.fwd + L * block.fwd + head * (edge_out.fwd + ce_fwd)
    calls_fwd = embed * edge_in.calls_fwd + L * block.calls_fwd
    calls_fwd += head * (edge_out.calls_fwd + ce_calls)
    bwd = embed * edge_in.bwd + L * block.bwd + head * edge_out.bwd
    calls_bwd = embed * edge_in.calls_bwd + L * block.calls_bwd + head * edge_out.calls_bwd
    if act_ckpt == "block":  # the whole block re-forward re-issues its collectives
        recompute, calls_recompute = L * block.fwd, L * block.calls_fwd
    else:  # "none", or "lowrank" whose regions hold no collective
        recompute, calls_recompute = 0, 0
    return CommVolume(fwd, bwd, recompute, calls_fwd, calls_bwd, calls_recompute)


def per_block_forward(cfg: ModelConfig, strategy: str, tp: int, tokens: int, **options) -> int:
    """Forward bytes of one block alone (the per-block comparison of docs/design.md §3)."""
    two = tp_comm_volume(replace(cfg, n_layers=2), strategy, tp, tokens, **options)
    one = tp_comm_volume(replace(cfg, n_layers=1), strategy, tp, tokens, **options)
    return two.fwd - one.fwd


def pp_send_bytes(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    micro_tokens: int,
    microbatches: int,
    first: bool,
    last: bool,
    act_size: int = FP32,
    layers: range | None = None,
) -> int:
    """Point-to-point bytes one pipeline rank sends per schedule step (one stage per rank).

    A stage sends its output activations forward (unless last) and its input gradients
    back (unless first), once per pipeline micro-batch of ``micro_tokens`` tokens: the
    residual (BTP: this rank's ``d/t`` slice; else the whole ``d``) in fp32, plus the LaX
    ``[T, r]`` latents the receiving block reads (``crossing_latents``: seven, six into an
    MoE block) in the compute dtype (``act_size``), as
    ``boostlr.parallel.tensor_parallel.boundary_dtypes`` declares; each gradient travels
    back in its activation's dtype. ``layers``: the stage's blocks (its boundaries are
    into ``layers.start`` and ``layers.stop``); ``None``: boundaries into dense blocks.
    """
    spec = spec_or_none(strategy)
    d = spec.residual_width(cfg.dim, tp) if spec else cfg.dim
    residual = micro_tokens * d * FP32
    if layers is None:
        into_next = into_this = len(LINEARS) if arch_spec(cfg.arch).crossing else 0
    else:
        into_next = len(crossing_latents(cfg, layers.stop))
        into_this = len(crossing_latents(cfg, layers.start))
    latent = micro_tokens * (cfg.rank or 0) * act_size
    fwd, bwd = residual + into_next * latent, residual + into_this * latent
    return microbatches * ((0 if last else fwd) + (0 if first else bwd))


def vocab_dp(cfg: ModelConfig, p: ParallelConfig) -> int:
    """dp ranks the embedding's and head's rows are split over (1: FSDP's, or no dp).

    As ``boostlr.parallel.build.splits_vocab_over_dp``: untied tables under data parallelism,
    unless ``parallel.vocab_dp`` is off. ``p.vocab_dp`` must be resolved (``auto`` depends
    on the batch: :func:`boostlr.config.resolve_vocab_dp`).
    """
    if not isinstance(p.vocab_dp, bool):
        raise ValueError("parallel.vocab_dp is unresolved ('auto'): call resolve_vocab_dp first")
    return p.dp if p.dp > 1 and p.vocab_dp and not cfg.tie_embeddings else 1


def vocab_dp_bytes(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    split_dp: int,
    tokens: int,
    first: bool,
    last: bool,
    act_size: int = FP32,
) -> int:
    """dp traffic of an embedding and LM head whose rows are split over dp, per micro-batch.

    Per micro-batch of ``tokens`` tokens on each rank (payload = the full buffer, as FSDP's):
    the embedding gathers every dp rank's token ids (int64), reduce-scatters the partial
    embeddings (fp32; BTP's are ``d/t`` wide) and gathers their gradient; the head gathers
    the targets, the head input (``act_size``) and reduce-scatters its gradient, and combines
    the loss's three ``[T]`` statistics over dp. ``split_dp`` is :func:`vocab_dp`'s count;
    at 1 (a tied table, ``parallel.vocab_dp`` off, no dp) FSDP carries the tables: nothing here.
    """
    if split_dp == 1:
        return 0
    T, ids = split_dp * tokens, 8
    out = 0
    if first:
        spec = spec_or_none(strategy)
        cols = spec.residual_width(cfg.dim, tp) if spec else cfg.dim
        out += T * ids + 2 * T * cols * FP32
    if last:
        out += T * ids + 2 * T * cfg.dim * act_size + 3 * T * FP32
    return out


def fsdp_bytes(
    module_shard_elements: list[int],
    dp: int,
    micro_batches: int,
    reshard: bool,
    param_bytes: int = FP32,
) -> int:
    """FSDP2 traffic of one rank per step without pipelining (payload = the full buffer).

    Each module (every block, then the root) all-gathers its parameters in every forward,
    again in the backward when resharded (``fsdp`` mode), and reduce-scatters its fp32
    gradients after every backward. ``module_shard_elements[i]``: module i's padded local
    shard; ``param_bytes``: the gathered dtype's size (2 under bf16 mixed precision).
    """
    if dp == 1:
        return 0
    full = sum(n * dp for n in module_shard_elements)
    gathers = 2 if reshard else 1
    return micro_batches * full * (gathers * param_bytes + FP32)


def fsdp_pipeline_bytes(
    module_shard_elements: list[int],
    dp: int,
    micro_batches: int,
    reshard: bool,
    pp_microbatches: int,
    param_bytes: int = FP32,
) -> int:
    """FSDP2 traffic of one pipeline rank per step (payload = the full buffer).

    ``fsdp`` (``reshard``): every pipeline micro-batch gathers each module in its forward and
    backward and reduce-scatters its gradients; ``ddp``: one gather and one reduce-scatter
    per schedule step. ``micro_batches`` schedule steps (``grad_accum``) repeat all of it.
    """
    if dp == 1:
        return 0
    full = sum(n * dp for n in module_shard_elements)
    if reshard:
        per_step = pp_microbatches * (2 * param_bytes + FP32)
    else:
        per_step = param_bytes + FP32
    return micro_batches * per_step * full
