"""Predict a training step: traffic, memory and time of any model x strategy x layout x GPU.

Arithmetic on shapes (docs/design.md §6). Bytes come from :mod:`boostlr.analysis.comm`, whose
formulas the tests check against the ledger of real runs (``comm_metrics`` is exactly what
``ParallelModel.step_metrics`` reports for the same rank). Time is a model:

* each GEMM on a roofline, ``max(flops / (peak * eff(M, K, N)), bytes / bandwidth)``, ``eff``
  falling for small dims; attention on it times ``attention_efficiency``;
* element-wise work (``gemms.block_elementwise``) as bytes over the effective bandwidth, and
  a launch per kernel (each GEMM, and ``gemms.block_kernels``' estimate of the rest); host
  Python is assumed to overlap the asynchronous kernels, as on a GPU;
* the optimizer step as the trainer runs it: clipping, then fused AdamW;
* alpha-beta collectives (ring all-reduce ``2(g-1)(α + n/(g·B))``, all-gather and
  reduce-scatter half of that, point-to-point ``α + n/B``) on the intra- or inter-node link
  the group spans (ranks laid out tp-fastest, then dp, then pp);
* the pipeline: ``(m·v + p - 1)`` slots of one virtual stage (the bubble is the ``p - 1``);
* overlap: FSDP's traffic beyond the step's compute (plus one module's) is exposed; TP
  collectives sit on the autograd critical path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from boostlr.analysis.comm import (
    CommVolume,
    fsdp_bytes,
    fsdp_pipeline_bytes,
    per_block_forward,
    pp_send_bytes,
    tp_comm_volume,
    vocab_dp,
    vocab_dp_bytes,
)
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
from boostlr.analysis.memory import (
    BF16_CACHE,
    FP32,
    RankParams,
    activation_bytes_per_block,
    grads_held_at_activation_peak,
    in_flight,
    rank_params,
    stage_modules,
)
from boostlr.analysis.prediction import Prediction, planned_layout
from boostlr.config import PRESETS, ModelConfig, ParallelConfig, RunConfig, resolve_vocab_dp

# The optimizer step as the trainer runs it (``train/loop.py``): gradient clipping (two
# foreach ops), then fused AdamW, one kernel per parameter group on plain tensors and on
# DTensor shards alike. fp32 bytes per parameter, every operand read and every result written
# once (tests/test_costmodel.py checks torch dispatches one kernel for it):
FUSED_ADAMW_BYTES = 28  # one kernel: read p, g, m, v; write p, m, v
CLIP_PASSES = (4, 8)  # _foreach_norm (read g), then clip_grads_with_norm_'s _foreach_mul_


def planning_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the vocabulary set (0 = take it from the preset, as the data would).

    ``parallel.vocab_dp auto`` is resolved with that vocabulary
    (:func:`~boostlr.config.resolve_vocab_dp`). A copy only when either is missing (the
    config is read, never written, here, and a layout search calls this thousands of
    times)."""
    if cfg.model.vocab_size >= 1 and isinstance(cfg.parallel.vocab_dp, bool):
        return cfg
    out = copy.deepcopy(cfg)
    if out.model.vocab_size < 1:
        out.model.vocab_size = PRESETS[out.model.preset].vocab_size
    resolve_vocab_dp(out)
    return out


def act_size(cfg: RunConfig) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else FP32


def _micro(cfg: RunConfig) -> tuple[int, int, int]:
    """(sequences per pipeline micro-batch, pipeline micro-batches, schedule steps)."""
    p, t = cfg.parallel, cfg.train
    m = p.pp_microbatches if p.pp > 1 else 1
    return t.batch_size // m, m, t.grad_accum


def _edge_ranks(cfg: RunConfig) -> list[int]:
    """The pp ranks that can be the slowest or fullest: the first (embedding, most micro-
    batches in flight) and the last (head, loss); the others hold only blocks."""
    return sorted({0, cfg.parallel.pp - 1})


# ----------------------------------------------------------------------------- bytes


def comm_metrics(cfg: RunConfig, pp_rank: int = 0, tp_rank: int = 0) -> dict[str, int]:
    """One rank's traffic in one optimizer step, keyed like ``ParallelModel.step_metrics``."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    seqs, mb, steps = _micro(cfg)
    tokens = seqs * cfg.data.seq_len
    a = act_size(cfg)
    tp = {k: 0 for k in ("bytes", "calls", "bytes_fwd", "bytes_bwd", "bytes_recompute")}
    pp_bytes = 0
    for layers, first, last in stage_modules(p, m.n_layers, pp_rank):
        if strategy is not None:
            vol = _stage_volume(m, p, strategy, tokens, a, len(layers), first, last)
            for k, v in vol.metrics(mb * steps).items():
                tp[k.removeprefix("comm_tp_")] += v
        if p.pp > 1:
            pp_bytes += steps * pp_send_bytes(m, strategy, p.tp, tokens, mb, first, last, a)
    params = rank_params(m, strategy, p, pp_rank, tp_rank)
    gathered = act_size(cfg)  # bf16: FSDP's mixed precision gathers bf16 parameters
    fsdp = p.data_parallel_mode == "fsdp"
    if p.pp > 1:
        dp = fsdp_pipeline_bytes(list(params.modules), p.dp, steps, fsdp, mb, gathered)
    else:
        dp = fsdp_bytes(list(params.modules), p.dp, steps, fsdp, gathered)
    dp += vocab_step_bytes(cfg, pp_rank)
    return {
        **{f"comm_tp_{k}": v for k, v in tp.items()},
        "comm_dp_bytes": dp,
        "comm_pp_bytes": pp_bytes,
    }


def vocab_step_bytes(cfg: RunConfig, pp_rank: int = 0) -> int:
    """One rank's dp traffic in one step for an embedding and head split over dp."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    seqs, mb, steps = _micro(cfg)
    tokens = seqs * cfg.data.seq_len
    strategy = p.strategy_for(m.arch)
    return (
        steps
        * mb
        * sum(
            vocab_dp_bytes(m, strategy, p.tp, vocab_dp(m, p), tokens, first, last, act_size(cfg))
            for _, first, last in stage_modules(p, m.n_layers, pp_rank)
        )
    )


# ----------------------------------------------------------------------------- time


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

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd + self.recompute

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm


def stage_time(cfg: RunConfig, hw: HardwareProfile, pp_rank: int) -> StageTime:
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    seqs, _, _ = _micro(cfg)
    s, a = cfg.data.seq_len, act_size(cfg)
    tokens = seqs * s
    dtype = cfg.train.dtype
    overlap = p.tp_overlap and not cfg.train.compile  # as TPContext.overlap
    out = StageTime()
    for layers, first, last in stage_modules(p, m.n_layers, pp_rank):
        fwd = bwd = 0.0
        per_layer: dict[bool, tuple[float, float, float]] = {}
        for layer in layers:
            key = layer == 0 and m.arch == "lax"  # LaX's block 0 has no crossing gate
            if key not in per_layer:
                gemms = block_gemms(m, strategy, p.tp, seqs, s, layer, p.grouping)
                back = [b for g in gemms for b in backward(g)]
                ew = block_elementwise(m, strategy, p.tp, tokens, a, layer, p.grouping, overlap)
                kernels = block_kernels(m, strategy, p.tp, layer, p.grouping)
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
            vol = _stage_volume(m, p, strategy, tokens, a, len(layers), first, last)
            # Costed as all-reduces (BTP's one last-hidden gather is a few % of its bytes).
            out.tp_comm += collective_time("all_reduce", vol.total, vol.calls, p.tp, p.tp, hw)
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


# ----------------------------------------------------------------------------- memory


def state_bytes(cfg: RunConfig, pp_rank: int = 0, tp_rank: int = 0) -> dict[str, float]:
    """fp32 parameters, gradients and AdamW state one rank keeps between steps."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    params = rank_params(m, p.strategy_for(m.arch), p, pp_rank, tp_rank)
    shard = params.sharded if p.dp > 1 else params.local  # FSDP shards all three over dp
    return {
        "params": FP32 * shard,
        "grads": FP32 * shard,
        "optimizer": 2 * FP32 * shard,  # AdamW exp_avg, exp_avg_sq
    }


def memory_breakdown(cfg: RunConfig, hw: HardwareProfile, pp_rank: int) -> dict[str, float]:
    """Bytes one rank (tp rank 0) needs at its peak, by what holds them."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    seqs, _, _ = _micro(cfg)
    tokens = seqs * cfg.data.seq_len
    a = act_size(cfg)
    params = rank_params(m, strategy, p, pp_rank)
    out = state_bytes(cfg, pp_rank)
    if p.dp > 1:
        if p.data_parallel_mode == "fsdp":
            # Two blocks (one prefetched) or the head/embedding unit, and the root (gathered
            # to the stage's backward end), with full grads; FSDP2's staging buffer on top.
            units = max(2 * params.largest_block, params.largest_module)
            out["gathered"] = FP32 * (2 * (units + params.roots) + params.largest_module)
        else:  # parameters stay gathered from forward to backward (a dp-split vocabulary not)
            gathered = params.local - params.vocab_local
            out["gathered"] = FP32 * (gathered + params.largest_module)
    if a == 2:
        out["bf16_weights"] = BF16_CACHE * params.local
    stages = stage_modules(p, m.n_layers, pp_rank)
    layers = sum(len(layers) for layers, _, _ in stages)
    per_block = activation_bytes_per_block(m, strategy, p.tp, tokens, a, p.act_ckpt)
    held = in_flight(p, pp_rank)
    acts = per_block * layers * held
    if p.act_ckpt != "none":  # one block's full activations while it is recomputed
        acts += activation_bytes_per_block(m, strategy, p.tp, tokens, a, "none")
    split_dp = vocab_dp(m, p)  # a vocabulary split over dp sees all dp tokens
    if any(last for _, _, last in stages):
        # The fused head keeps one [tokens, vocab] buffer in the compute dtype (a pipeline's
        # last stage too: its forward ends in the loss); the unfused loss about three, two of
        # them fp32.
        fused = cfg.train.fused_loss
        # Split over dp too, a rank has V/(dp·tp) rows for dp·T tokens: the same count.
        rows = -(-m.vocab_size // (p.tp if strategy else 1))
        acts += tokens * rows * (a if fused else a + 2 * FP32)
        if split_dp > 1:  # every dp rank's head input, kept for the head's backward
            acts += split_dp * tokens * m.dim * a
    if any(first for _, first, _ in stages) and split_dp > 1:
        # every dp rank's partial embeddings, until their reduce-scatter
        acts += split_dp * tokens * (m.dim // p.tp if strategy == "btp" else m.dim) * FP32
    out["activations"] = acts
    if cfg.train.grad_accum * (p.pp_microbatches if p.pp > 1 else 1) > 1 and params.head_own_grad:
        # The next micro-batch's head gradient, made before it is added to the held one.
        out["grad_accumulation"] = FP32 * params.head_own_grad
    if not grads_held_at_activation_peak(p, pp_rank, cfg.train.grad_accum) and layers > 1:
        # The step's gradients do not exist yet when the activations peak: the backward
        # frees one micro-batch's activations as it makes the gradients, so the two peak
        # apart: all activations and the first block's gradients at the start of the first
        # backward, or all gradients and the rest of the activations at its end.
        grads, per_micro = out["grads"], acts / held
        start = acts + grads / layers
        end = grads + acts - per_micro + per_micro / layers
        out["grads"], out["activations"] = (
            (grads / layers, acts) if start >= end else (grads, end - grads)
        )
    out["reserved"] = hw.reserved
    return out


# ----------------------------------------------------------------------------- the step


def predict(cfg: RunConfig, hw: HardwareProfile) -> Prediction:
    """Step time, traffic and memory of a resolved, validated config on ``hw``."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    seqs, mb, steps = _micro(cfg)
    v = p.virtual_stages
    a = act_size(cfg)
    ranks = _edge_ranks(cfg)
    stages = {r: stage_time(cfg, hw, r) for r in ranks}
    slowest = max(stages.values(), key=lambda st: st.total)
    per_slot = slowest.total / v  # one virtual stage, one micro-batch
    p2p = 0.0
    if p.pp > 1:
        one = pp_send_bytes(m, strategy, p.tp, seqs * cfg.data.seq_len, 1, False, True, a)
        bw, alpha = link_bandwidth(hw, 2, p.world_size)
        p2p = 2 * (alpha + hw.launch + one / bw)  # one receive each way per slot
    slots = mb * v
    busy = steps * slots * per_slot
    bubble = steps * (p.pp - 1) * per_slot
    pp_comm = steps * (slots + p.pp - 1) * p2p
    tp_comm = steps * mb * slowest.tp_comm
    compute_only = steps * mb * slowest.compute
    # Data parallel: the slowest edge rank's FSDP traffic; hidden behind compute except the
    # first gather and the last reduce-scatter (one module's share). The traffic of a
    # vocabulary split over dp carries activations the next op waits for: all exposed.
    dp_exposed = 0.0
    dp_total = 0.0
    params = {r: rank_params(m, strategy, p, r) for r in ranks}
    if p.dp > 1:
        for r in ranks:
            vocab = vocab_step_bytes(cfg, r)
            nbytes = comm_metrics(cfg, r)["comm_dp_bytes"] - vocab
            modules = max(1, sum(1 for n in params[r].modules if n))
            if p.data_parallel_mode == "fsdp":  # per (pipeline) micro-batch: 2 gathers, 1 reduction
                calls = steps * (mb if p.pp > 1 else 1) * modules * 3
            else:  # gathered once per step, reduced once
                calls = steps * modules * 2
            span = p.dp * p.tp
            t_dp = collective_time("all_gather", nbytes, calls, p.dp, span, hw)
            exposed = max(0.0, t_dp - compute_only) + t_dp / modules
            if vocab:  # embedding: 3 calls, head: 6, per micro-batch
                edges = sum(
                    3 * first + 6 * last for _, first, last in stage_modules(p, m.n_layers, r)
                )
                t_vocab = collective_time("all_gather", vocab, steps * mb * edges, p.dp, span, hw)
                t_dp, exposed = t_dp + t_vocab, exposed + t_vocab
            if exposed > dp_exposed:
                dp_exposed, dp_total = exposed, t_dp
    optimizer = max(optimizer_time(cfg, hw, params[r]) for r in ranks)
    compute = compute_only + optimizer
    comm = tp_comm + pp_comm + dp_exposed
    step = busy + bubble + pp_comm + dp_exposed + optimizer
    memories = {r: memory_breakdown(cfg, hw, r) for r in ranks}
    worst = max(memories.values(), key=lambda mem: sum(mem.values()))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    per_block = per_block_forward(m, strategy, p.tp, tokens, act_size=a) if strategy else 0
    gemms = block_gemms(m, strategy, p.tp, seqs, cfg.data.seq_len, 1, p.grouping)
    return Prediction(
        arch=m.arch,
        strategy=strategy,
        layout=planned_layout(cfg),
        step_time=step,
        compute=compute,
        comm=comm,
        bubble=bubble,
        parts={
            "gemm_elementwise_s": steps * mb * (slowest.fwd + slowest.bwd),
            "recompute_s": steps * mb * slowest.recompute,
            "optimizer_s": optimizer,
            "tp_comm_s": tp_comm,
            "pp_comm_s": pp_comm,
            "dp_comm_s": dp_total,
            "dp_comm_exposed_s": dp_exposed,
            "bubble_s": bubble,
        },
        memory=worst,
        fits=sum(worst.values()) <= hw.memory,
        comm_bytes=comm_metrics(cfg, 0),
        tp_bytes_fwd_per_block=per_block,
        gemms=[
            {
                "name": g.name,
                "m": g.m,
                "k": g.k,
                "n": g.n,
                "count": g.count,
                "kind": g.kind,
                "flops": g.flops,
                "intensity": g.intensity(a),
            }
            for g in gemms
        ],
        flops_per_rank=steps * mb * slowest.flops,
    )


def _stage_volume(
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
