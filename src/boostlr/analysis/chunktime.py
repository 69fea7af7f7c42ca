"""Time of one pipeline rank's chunks: a micro-batch's forward and backward.

The per-kernel and per-collective terms of the step-time model (``costmodel`` composes them
into a step, ``schedule`` into a pipeline's span):

* each GEMM on a roofline, ``max(flops / (peak * eff(M, K, N)), bytes / bandwidth)``, ``eff``
  falling for small dims; attention on it times ``attention_efficiency``;
* element-wise work (``gemms.block_elementwise``) as bytes over the effective bandwidth, and
  a launch per kernel (each GEMM, and ``gemms.block_kernels``' estimate of the rest);
* TP collectives on the autograd critical path, in the chunk that issues them (a forward's
  delay the next stage too);
* alpha-beta collectives (ring all-reduce ``base + 2(g-1)·alpha + 2(g-1)/g · n/B``,
  all-gather and reduce-scatter ``g-1`` steps) on the intra- or inter-node link the group
  spans;
* a launch per kernel, eager or compiled (``train.compile``); the step's fixed costs
  (optimizer, clipping, casts, accumulation) are :mod:`boostlr.analysis.fixed`'s.
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
from boostlr.analysis.memory import FP32, stage_modules
from boostlr.analysis.moe import btp_moe_block_extra
from boostlr.config import ModelConfig, ParallelConfig, RunConfig
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe_layer, moe_layer_count


def act_size(cfg: RunConfig) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else FP32


def microbatching(cfg: RunConfig) -> tuple[int, int, int]:
    """(sequences per pipeline micro-batch, pipeline micro-batches, schedule steps)."""
    p, t = cfg.parallel, cfg.train
    m = p.pp_microbatches if p.pp > 1 else 1
    return t.batch_size // m, m, t.grad_accum


def gemm_time(g: Gemm, hw: HardwareProfile, dtype: str, elem: int) -> float:
    """Roofline time of one (batched) GEMM plus its launch; a linear's tiles run in waves
    over the SMs (flash attention's own tiling is left in ``attention_efficiency``)."""
    attention = g.kind == "attention"
    eff = hw.gemm_eff(g.m, g.k, g.n, g.count, waves=not attention)
    if attention:
        eff *= hw.attention_efficiency
    compute = g.flops / (hw.flops(dtype) * eff)
    memory = g.bytes(elem) / hw.hbm_bandwidth  # the roofline: the bandwidth itself
    return max(compute, memory) + hw.launch


def memory_time(nbytes: float, hw: HardwareProfile, kernels: int = 0) -> float:
    return nbytes / (hw.hbm_bandwidth * hw.memory_efficiency) + kernels * hw.launch


def stream_time(nbytes: float, hw: HardwareProfile, kernels: int = 0) -> float:
    """A long streaming pass (optimizer, casts, accumulation) at the card's STREAM-type
    bandwidth, not the element-wise fit."""
    return nbytes / (hw.hbm_bandwidth * hw.stream_efficiency) + kernels * hw.launch


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


def _ring_steps(op: str, group: int) -> int:
    return 2 * (group - 1) if op == "all_reduce" else group - 1


def collective_alpha(op: str, calls: int, group: int, span: int, hw: HardwareProfile) -> float:
    """The size-independent part of ``calls`` ring collectives (α): per call the link's base
    latency, a per-step latency for each of the ring's steps, and a launch (NCCL's own cost
    model, ``src/graph/tuning.cc``: ``baseLat + nsteps · hwLat``)."""
    if group <= 1 or calls == 0:
        return 0.0
    link = hw.link(span)
    return calls * (link.base_latency + _ring_steps(op, group) * link.latency + hw.launch)


def collective_time(
    op: str, nbytes: float, calls: int, group: int, span: int, hw: HardwareProfile
) -> float:
    """Ring algorithms, α + β; ``nbytes`` is the ledger's payload (the full buffer)."""
    if group <= 1 or calls == 0:
        return 0.0
    bw, _ = link_bandwidth(hw, group, span)
    beta = _ring_steps(op, group) / group * nbytes / bw
    return collective_alpha(op, calls, group, span, hw) + beta


@dataclass
class StageTime:
    """One pipeline micro-batch through one rank's stages."""

    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    flops: float = 0.0
    tp_comm_fwd: float = 0.0  # the forward's share of ``tp_comm`` (it delays the next stage)
    tp_alpha: float = 0.0  # the latency (α) share of ``tp_comm``
    kernels: int = 0  # kernels launched (GEMMs, element-wise, collectives), recompute included

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
        kernels_fwd = kernels_all = 0
        per_layer: dict[tuple[bool, bool], tuple[float, float, float, int, int]] = {}
        for layer in layers:
            # A crossing arch's block 0 has no crossing gate; an MoE model's first
            # ``moe_dense_layers`` blocks keep the dense MLP.
            key = (layer == 0 and crossing, is_moe_layer(m, layer))
            if key not in per_layer:
                gemms = block_gemms(m, strategy, p.tp, seqs, s, layer, p.grouping, p.ep)
                back = [b for g in gemms for b in backward(g)]
                ew = block_elementwise(m, strategy, p.tp, tokens, a, layer, p.grouping, overlap)
                kernels = block_kernels(m, strategy, p.tp, layer, p.grouping, p.ep)
                if cfg.train.compile:  # each region one graph: a fused kernel per GEMM
                    kernels = compiled_kernels(len(gemms), len(back))
                ew_f, ew_b = elementwise_time(ew, kernels, hw)
                per_layer[key] = (
                    sum(gemm_time(g, hw, dtype, a) for g in gemms) + ew_f,
                    sum(gemm_time(b, hw, dtype, a) for b in back) + ew_b,
                    sum(g.flops for g in gemms) + sum(b.flops for b in back),
                    len(gemms) + kernels[0],
                    len(back) + kernels[1],
                )
            f_time, b_time, flops, k_fwd, k_bwd = per_layer[key]
            fwd, bwd, out.flops = fwd + f_time, bwd + b_time, out.flops + flops
            kernels_fwd, kernels_all = kernels_fwd + k_fwd, kernels_all + k_fwd + k_bwd
        if p.act_ckpt != "none":  # every GEMM of a block sits in a checkpointed region
            out.recompute += fwd
            kernels_all += kernels_fwd
        if last:  # with the embedding and the RoPE tables (a first stage's, a few %)
            head = head_gemms(m, strategy, p.tp, tokens)
            fwd += sum(gemm_time(g, hw, dtype, a) for g in head)
            bwd += sum(gemm_time(b, hw, dtype, a) for g in head for b in backward(g))
            fused = cfg.train.fused_loss  # a pipeline's last stage too
            head_ew = head_elementwise(m, strategy, p.tp, tokens, a, s, fused)
            kernels = head_kernels(m, strategy, p.tp, tokens, fused)
            ew_f, ew_b = elementwise_time(head_ew, kernels, hw)
            fwd, bwd = fwd + ew_f, bwd + ew_b
            kernels_all += 3 * len(head) + sum(kernels)
        out.fwd += fwd
        out.bwd += bwd
        out.kernels += kernels_all
        if strategy is not None and p.tp > 1:
            vol = stage_volume(m, p, strategy, tokens, a, layers, first, last)
            # Costed as all-reduces (BTP's one last-hidden gather is a few % of its bytes).
            fwd_comm = collective_time("all_reduce", vol.fwd, vol.calls_fwd, p.tp, p.tp, hw)
            out.tp_comm_fwd += fwd_comm
            out.tp_comm += fwd_comm + collective_time(
                "all_reduce", vol.bwd + vol.recompute, vol.calls_bwd + vol.calls_recompute,
                p.tp, p.tp, hw,
            )  # fmt: skip
            out.tp_alpha += collective_alpha("all_reduce", vol.calls, p.tp, p.tp, hw)
            out.kernels += vol.calls
    return out


def compiled_kernels(gemms_fwd: int, gemms_bwd: int) -> tuple[int, int]:
    """Non-GEMM kernels of a block under ``train.compile``: inductor fuses each
    collective-free region's element-wise work into the kernels between its GEMMs, about
    one per GEMM (an estimate, forward and backward; the bytes are not reduced)."""
    return gemms_fwd, gemms_bwd


def stage_volume(
    m: ModelConfig,
    p: ParallelConfig,
    strategy: str,
    tokens: int,
    act: int,
    layers: range,
    first: bool,
    last: bool,
) -> CommVolume:
    """The ledger's TP traffic of one pipeline stage (its ``layers``, embedding and head)
    per micro-batch; an MoE block's own (:func:`~boostlr.analysis.moe.btp_moe_block_extra`)
    included, the once-per-step sum of its gradients not."""
    vol = tp_comm_volume(
        replace(m, n_layers=len(layers)),
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
    n_moe = moe_layer_count(m, layers) if p.tp > 1 else 0
    if not n_moe:
        return vol
    fwd, bwd = (n_moe * b for b in btp_moe_block_extra(m, tokens, act))
    again = fwd if p.act_ckpt == "block" else 0
    return replace(vol, fwd=vol.fwd + fwd, bwd=vol.bwd + bwd, recompute=vol.recompute + again)
