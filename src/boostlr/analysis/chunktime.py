"""Time of one pipeline rank's chunks: a micro-batch's forward and backward, the optimizer.

The per-kernel and per-collective terms of the step-time model (``costmodel`` composes them
into a step, ``schedule`` into a pipeline's span):

* each GEMM on a roofline, ``max(flops / (peak * eff(M, K, N)), bytes / bandwidth)``, ``eff``
  falling for small dims; attention on it times ``attention_efficiency``;
* element-wise work (``gemms.block_elementwise``) as bytes over the effective bandwidth, and
  a launch per kernel (each GEMM, and ``gemms.block_kernels``' estimate of the rest);
* TP collectives on the autograd critical path, in the chunk that issues them (a forward's
  delay the next stage too);
* alpha-beta collectives (ring all-reduce ``2(g-1)(alpha + n/(g*B))``, all-gather and
  reduce-scatter half of that) on the intra- or inter-node link the group spans;
* the optimizer step as the trainer runs it: clipping, then fused AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boostlr.analysis.comm import CommVolume, tp_comm_volume, vocab_dp
from boostlr.analysis.gemms import (
    ElementWise,
    Gemm,
    backward,
    block_elementwise,
    block_gemms,
    block_kernels,
    head_elementwise,
    head_gemms,
    head_kernels,
)
from boostlr.analysis.hardware import HardwareProfile
from boostlr.analysis.memory import FP32, RankParams, stage_modules
from boostlr.config import ModelConfig, ParallelConfig, RunConfig
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe_layer

# The optimizer step as the trainer runs it (``train/loop.py``): gradient clipping (two
# foreach ops), then fused AdamW, one kernel per parameter group on plain tensors and on
# DTensor shards alike. fp32 bytes per parameter, every operand read and every result written
# once (tests/test_costmodel.py checks torch dispatches one kernel for it):
FUSED_ADAMW_BYTES = 28  # one kernel: read p, g, m, v; write p, m, v
CLIP_PASSES = (4, 8)  # _foreach_norm (read g), then clip_grads_with_norm_'s _foreach_mul_


def act_size(cfg: RunConfig) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else FP32


def microbatching(cfg: RunConfig) -> tuple[int, int, int]:
    """(sequences per pipeline micro-batch, pipeline micro-batches, schedule steps)."""
    p, t = cfg.parallel, cfg.train
    m = p.pp_microbatches if p.pp > 1 else 1
    return t.batch_size // m, m, t.grad_accum


def gemm_time(g: Gemm, hw: HardwareProfile, dtype: str, elem: int) -> float:
    """Roofline time of one (batched) GEMM plus its launch."""
    eff = hw.gemm_eff(g.m, g.k, g.n)
    if g.kind == "attention":
        eff *= hw.attention_efficiency
    compute = g.flops / (hw.flops(dtype) * eff)
    memory = g.bytes(elem) / hw.hbm_bandwidth  # the roofline: the bandwidth itself
    return max(compute, memory) + hw.launch


def memory_time(nbytes: float, hw: HardwareProfile, kernels: int = 0) -> float:
    return nbytes / (hw.hbm_bandwidth * hw.memory_efficiency) + kernels * hw.launch


def elementwise_time(
    ew: ElementWise, kernels: tuple[int, int], hw: HardwareProfile
) -> tuple[float, float]:
    """(forward, backward) seconds of non-GEMM kernels: bytes over the memory bandwidth plus
    a launch each."""
    return memory_time(ew.fwd, hw, kernels[0]), memory_time(ew.bwd, hw, kernels[1])


def link_bandwidth(hw: HardwareProfile, group: int, span: int) -> tuple[float, float]:
    """(bytes/s, latency) a group of ``group`` ranks spread over ``span`` consecutive ranks
    gets: inside a node of all-to-all links (``intra_mesh``) a group uses only its peers'."""
    link = hw.link(span)
    bw = link.bandwidth
    if span <= hw.gpus_per_node and hw.intra_mesh and hw.gpus_per_node > 1:
        bw *= (group - 1) / (hw.gpus_per_node - 1)
    return bw, link.latency


def collective_time(
    op: str, nbytes: float, calls: int, group: int, span: int, hw: HardwareProfile
) -> float:
    """Ring algorithms; ``nbytes`` is the ledger's payload (the full buffer)."""
    if group <= 1 or calls == 0:
        return 0.0
    bw, alpha = link_bandwidth(hw, group, span)
    steps = 2 * (group - 1) if op == "all_reduce" else group - 1
    return calls * (steps * alpha + hw.launch) + steps / group * nbytes / bw


@dataclass
class StageTime:
    """One pipeline micro-batch through one rank's stages."""

    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    flops: float = 0.0
    tp_comm_fwd: float = 0.0  # the forward's share of ``tp_comm`` (it delays the next stage)

    @property
    def forward(self) -> float:
        """The forward chunk as a schedule runs it: its TP collectives sit in its chain."""
        return self.fwd + self.tp_comm_fwd

    @property
    def backward(self) -> float:
        return self.total - self.forward

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd + self.recompute

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm


def stage_time(cfg: RunConfig, hw: HardwareProfile, pp_rank: int) -> StageTime:
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    crossing = arch_spec(m.arch).crossing
    seqs, _, _ = microbatching(cfg)
    s, a = cfg.data.seq_len, act_size(cfg)
    tokens = seqs * s
    dtype = cfg.train.dtype
    overlap = p.tp_overlap and not cfg.train.compile  # as TPContext.overlap
    out = StageTime()
    for layers, first, last in stage_modules(p, m.n_layers, pp_rank):
        fwd = bwd = 0.0
        per_layer: dict[tuple[bool, bool], tuple[float, float, float]] = {}
        for layer in layers:
            # A crossing arch's block 0 has no crossing gate; an MoE model's first
            # ``moe_dense_layers`` blocks keep the dense MLP.
            key = (layer == 0 and crossing, is_moe_layer(m, layer))
            if key not in per_layer:
                gemms = block_gemms(m, strategy, p.tp, seqs, s, layer, p.grouping, p.ep)
                back = [b for g in gemms for b in backward(g)]
                ew = block_elementwise(m, strategy, p.tp, tokens, a, layer, p.grouping, overlap)
                kernels = block_kernels(m, strategy, p.tp, layer, p.grouping, p.ep)
                ew_f, ew_b = elementwise_time(ew, kernels, hw)
                per_layer[key] = (
                    sum(gemm_time(g, hw, dtype, a) for g in gemms) + ew_f,
                    sum(gemm_time(b, hw, dtype, a) for b in back) + ew_b,
                    sum(g.flops for g in gemms) + sum(b.flops for b in back),
                )
            f_time, b_time, flops = per_layer[key]
            fwd, bwd, out.flops = fwd + f_time, bwd + b_time, out.flops + flops
        if p.act_ckpt != "none":  # every GEMM of a block sits in a checkpointed region
            out.recompute += fwd
        if last:  # with the embedding and the RoPE tables (a first stage's, a few %)
            head = head_gemms(m, strategy, p.tp, tokens)
            fwd += sum(gemm_time(g, hw, dtype, a) for g in head)
            bwd += sum(gemm_time(b, hw, dtype, a) for g in head for b in backward(g))
            fused = cfg.train.fused_loss  # a pipeline's last stage too
            head_ew = head_elementwise(m, strategy, p.tp, tokens, a, s, fused)
            kernels = head_kernels(m, strategy, p.tp, tokens, fused)
            ew_f, ew_b = elementwise_time(head_ew, kernels, hw)
            fwd, bwd = fwd + ew_f, bwd + ew_b
        out.fwd += fwd
        out.bwd += bwd
        if strategy is not None and p.tp > 1:
            vol = stage_volume(m, p, strategy, tokens, a, len(layers), first, last)
            # Costed as all-reduces (BTP's one last-hidden gather is a few % of its bytes).
            fwd_comm = collective_time("all_reduce", vol.fwd, vol.calls_fwd, p.tp, p.tp, hw)
            out.tp_comm_fwd += fwd_comm
            out.tp_comm += fwd_comm + collective_time(
                "all_reduce", vol.bwd + vol.recompute, vol.calls_bwd + vol.calls_recompute,
                p.tp, p.tp, hw,
            )  # fmt: skip
    return out


def optimizer_time(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> float:
    """Gradient clipping and the AdamW step on one rank's shard, as the trainer runs them.

    Memory-bound passes over the fp32 shard: the clipping norm and scale, then one fused
    AdamW kernel (DTensor shards included). The clipping norm is all-reduced (a scalar) over
    every mesh dim of size > 1.
    """
    p = cfg.parallel
    shard = params.sharded if p.dp > 1 else params.local
    clip = CLIP_PASSES if cfg.train.grad_clip > 0 else CLIP_PASSES[:1]  # the norm is logged
    step = memory_time(sum(clip) * shard, hw, len(clip))
    step += memory_time(FUSED_ADAMW_BYTES * shard, hw, 1)  # one op over the tensor list
    for size, span in ((p.tp, p.tp), (p.dp, p.tp * p.dp), (p.pp, p.world_size)):
        step += collective_time("all_reduce", FP32, 1, size, span, hw)
    return step


def stage_volume(
    m: ModelConfig,
    p: ParallelConfig,
    strategy: str,
    tokens: int,
    act: int,
    n_layers: int,
    first: bool,
    last: bool,
) -> CommVolume:
    """The ledger's TP traffic of one pipeline stage (its layers, embedding and head)."""
    return tp_comm_volume(
        replace(m, n_layers=n_layers),
        strategy,
        p.tp,
        tokens,
        norm=p.norm,
        grouping=p.grouping,
        act_ckpt=p.act_ckpt,
        act_size=act,
        first=first,
        last=last,
        vocab_dp=vocab_dp(m, p),
    )
