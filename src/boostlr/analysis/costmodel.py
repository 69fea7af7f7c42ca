"""Predict a training step: traffic, memory and time of any model x strategy x layout x GPU.

Arithmetic on shapes (docs/design.md §6). Bytes come from :mod:`boostlr.analysis.comm`, whose
formulas the tests check against the ledger of real runs (``comm_metrics`` is exactly what
``ParallelModel.step_metrics`` reports for the same rank). Time is a model:

* each rank's forward and backward of one micro-batch, and the optimizer step, from
  :mod:`boostlr.analysis.chunktime` (GEMMs on a roofline, element-wise bytes, launches, TP
  collectives on the critical path);
* the pipeline as torch's schedule runs it (:mod:`boostlr.analysis.schedule`): every rank's
  program of chunks and point-to-point exchanges (``α + n/B`` per boundary, on the link the
  pp ranks span; ranks laid out tp-fastest, then dp, then pp), timed; the bubble is what
  the slowest rank waits; interleaved keeps ``(m·v + p - 1)`` slots of one virtual stage
  (how each schedule is timed is its spec's, ``specs/schedule.py``);
* overlap: FSDP's traffic beyond the step's compute (plus one module's) is exposed; under a
  pipeline in ``ddp`` mode the stage's gradient reduction after the last backward is exposed
  whole;
* the step's fixed costs (:mod:`boostlr.analysis.fixed`: optimizer, clipping, gradient
  accumulation, weight casts, the host's dispatch beyond the launches) in series after the
  schedule; the launches and the collective latency (α) inside the times above are
  reported as their share (``fixed``).
"""

from __future__ import annotations

import copy

from boostlr.analysis.chunktime import (
    StageTime,
    act_size,
    collective_alpha,
    collective_time,
    elementwise_time,
    gemm_time,
    link_bandwidth,
    memory_time,
    microbatching,
    stage_time,
    stage_volume,
)
from boostlr.analysis.comm import (
    fsdp_bytes,
    fsdp_pipeline_bytes,
    per_block_forward,
    pp_send_bytes,
    vocab_dp,
    vocab_dp_bytes,
)
from boostlr.analysis.fixed import (
    CLIP_PASSES,
    FUSED_ADAMW_BYTES,
    fixed_parts,
    host_dispatch_time,
    host_ops,
    kernel_mode,
    optimizer_time,
)
from boostlr.analysis.gemms import block_gemms
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
from boostlr.analysis.moe import (
    btp_moe_activation_extra,
    buffer_bytes,
    dense_mlp_activation,
    ep_micro_bytes,
    expert_grad_bytes,
    moe_mlp_activation,
    tp_summed_grad_elements,
)
from boostlr.analysis.moe_time import moe_comm_times, planned_moe_summary
from boostlr.analysis.prediction import Prediction, planned_layout
from boostlr.analysis.schedule import interleaved_span, pipeline_span
from boostlr.config import PRESETS, RunConfig, resolve_vocab_dp
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe, moe_layer_count
from boostlr.specs.schedule import VIRTUAL_SLOTS, schedule_spec
from boostlr.specs.strategy import spec_or_none

__all__ = [  # the time primitives live in chunktime; callers import them from here too
    "CLIP_PASSES",
    "FUSED_ADAMW_BYTES",
    "Prediction",
    "StageTime",
    "collective_time",
    "elementwise_time",
    "gemm_time",
    "link_bandwidth",
    "memory_time",
    "optimizer_time",
    "fixed_parts",
    "stage_time",
    "comm_metrics",
    "memory_breakdown",
    "planning_config",
    "predict",
    "state_bytes",
    "vocab_step_bytes",
]


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
    seqs, mb, steps = microbatching(cfg)
    tokens = seqs * cfg.data.seq_len
    a = act_size(cfg)
    tp = {k: 0 for k in ("bytes", "calls", "bytes_fwd", "bytes_bwd", "bytes_recompute")}
    pp_bytes = 0
    for layers, first, last in stage_modules(p, m.n_layers, pp_rank):
        if strategy is not None:
            vol = stage_volume(m, p, strategy, tokens, a, layers, first, last)
            for k, v in vol.metrics(mb * steps).items():
                tp[k.removeprefix("comm_tp_")] += v
            # BTP's MoE gradients: summed over tp once per optimizer step, in one call.
            summed = FP32 * tp_summed_grad_elements(m, p, layers)
            if summed:
                tp["bytes"] += summed
                tp["bytes_bwd"] += summed
                tp["calls"] += 1
        if p.pp > 1:
            sent = pp_send_bytes(m, strategy, p.tp, tokens, mb, first, last, a, layers)
            pp_bytes += steps * sent
    params = rank_params(m, strategy, p, pp_rank, tp_rank)
    gathered = act_size(cfg)  # bf16: FSDP's mixed precision gathers bf16 parameters
    fsdp = p.data_parallel_mode == "fsdp"
    if p.pp > 1:
        dp = fsdp_pipeline_bytes(list(params.modules), p.dp, steps, fsdp, mb, gathered)
    else:
        dp = fsdp_bytes(list(params.modules), p.dp, steps, fsdp, gathered)
    dp += vocab_step_bytes(cfg, pp_rank)
    out = {
        **{f"comm_tp_{k}": v for k, v in tp.items()},
        "comm_dp_bytes": dp,
        "comm_pp_bytes": pp_bytes,
    }
    if is_moe(m):  # the ledger's groups ep and dp_rep (analysis/moe.py)
        out["comm_ep_bytes"] = steps * mb * ep_micro_bytes(m, p, tokens, a)
        units = params.expert_units
        out["comm_dp_rep_bytes"] = expert_grad_bytes(p, units, steps, mb, gathered)
    return out


def vocab_step_bytes(cfg: RunConfig, pp_rank: int = 0) -> int:
    """One rank's dp traffic in one step for an embedding and head split over dp."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    seqs, mb, steps = microbatching(cfg)
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


def memory_breakdown(cfg: RunConfig, hw: HardwareProfile | None, pp_rank: int) -> dict[str, float]:
    """Bytes one rank (tp rank 0) needs at its peak, by what holds them (the profile's
    reserve too; none without a profile)."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    spec = spec_or_none(strategy)
    seqs, _, _ = microbatching(cfg)
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
            # A routed-expert unit over dp_rep (one layer's E/ep experts), gathered in the
            # FSDP dtype beside its block (its gradient comes in the backward, as that
            # layer's activations go).
            out["gathered"] += a * params.largest_expert_unit
        else:  # parameters stay gathered from forward to backward (a dp-split vocabulary not)
            # in FSDP's param dtype (the compute dtype under bf16).
            # Routed experts held whole (ep = dp) are not gathered; over dp_rep > 1 they are.
            whole = 0 if params.expert_units else params.experts
            gathered = params.local - params.vocab_local - whole
            out["gathered"] = a * gathered + FP32 * params.largest_module
            if p.pp > 1:
                # torch's pipeline stage keeps the gradients unsharded (reduce dtype, fp32)
                # from the first backward until the step's last one reduce-scatters them;
                # the sharded ones appear only then, after the micro-batches' activations.
                out["grads"] = FP32 * gathered
    if a == 2:
        # The GEMMs save the bf16 copies of the weights they read (``local(param)``, not a
        # leaf, so autocast caches none): every weight's until its backward without
        # recompute; under recompute only the recomputed block's, while it runs again.
        # At dp > 1 FSDP's mixed precision gathers bf16 already: there is nothing to copy.
        held = params.local if p.act_ckpt == "none" else params.largest_block
        out["bf16_weights"] = BF16_CACHE * held if p.dp == 1 else 0.0
    stages = stage_modules(p, m.n_layers, pp_rank)
    layers = sum(len(layers) for layers, _, _ in stages)
    per_block = activation_bytes_per_block(m, strategy, p.tp, tokens, a, p.act_ckpt)
    held = in_flight(p, pp_rank)
    acts = per_block * layers * held
    if p.act_ckpt != "none":  # one block's full activations while it is recomputed
        acts += activation_bytes_per_block(m, strategy, p.tp, tokens, a, "none")
    if is_moe(m):
        # MoE blocks keep their experts' tensors instead of the dense MLP's
        if p.tp > 1 and strategy is not None:  # BTP's MoE block: each rank's token share
            moe = btp_moe_activation_extra(m, tokens, a, p.ep, p.dp, p.tp)
        else:
            moe = moe_mlp_activation(m, tokens, a, p.ep, p.dp) - dense_mlp_activation(m, tokens, a)
        n_moe = sum(moe_layer_count(m, ls) for ls, _, _ in stages)
        acts += max(0.0, moe) if p.act_ckpt != "none" else moe * n_moe * held
        out["buffers"] = float(sum(buffer_bytes(m, ls) for ls, _, _ in stages))
    split_dp = vocab_dp(m, p)  # a vocabulary split over dp sees all dp tokens
    if any(last for _, _, last in stages):
        # The final norm, outside every block (rms_norm's fp32 input and x·rsqrt and its
        # output's GEMM cast; BTP's folded one: its fp32 slice, normalised and gained).
        # Under recompute the peak is a block's re-forward, after the norm's backward.
        res = spec.residual_width(m.dim, p.tp) if spec else m.dim
        if p.act_ckpt == "none":
            folded = spec is not None and spec.bottleneck_regions
            acts += tokens * res * (FP32 + 2 * a if folded else 2 * FP32 + a)
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
        acts += split_dp * tokens * (spec.residual_width(m.dim, p.tp) if spec else m.dim) * FP32
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
    out["reserved"] = hw.reserved if hw is not None else 0.0
    return out


# ----------------------------------------------------------------------------- the step


def predict(cfg: RunConfig, hw: HardwareProfile) -> Prediction:
    """Step time, traffic and memory of a resolved, validated config on ``hw``."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    strategy = p.strategy_for(m.arch)
    seqs, mb, steps = microbatching(cfg)
    v = p.virtual_stages
    a = act_size(cfg)
    ranks = _edge_ranks(cfg)
    stages = _all_stage_times(cfg, hw)
    slowest = max(stages, key=lambda st: st.total)
    busy = steps * mb * slowest.total  # the slowest rank's chunks
    if p.pp == 1:
        bubble = pp_comm = pp_alpha = 0.0
    else:
        one = pp_send_bytes(m, strategy, p.tp, seqs * cfg.data.seq_len, 1, False, True, a)
        bw, alpha = link_bandwidth(hw, 2, p.world_size)
        hop_alpha = hw.link(p.world_size).base_latency + alpha + hw.launch
        hop = hop_alpha + one / bw  # one boundary, either way (a grad is its act's size)
        if schedule_spec(p.pp_schedule).timing == VIRTUAL_SLOTS:  # one hop each way per slot
            span0 = interleaved_span(mb, v, p.pp, slowest.total)
            span = span0 + (mb * v + p.pp - 1) * 2 * hop
        else:  # torch's own program for every rank, timed (analysis/schedule.py)
            fwd, bwd = [st.forward for st in stages], [st.backward for st in stages]
            span0 = pipeline_span(p.pp_schedule, mb, fwd, bwd, {"act": 0.0, "grad": 0.0})
            span = pipeline_span(p.pp_schedule, mb, fwd, bwd, {"act": hop, "grad": hop})
        bubble = steps * span0 - busy  # idle waiting for neighbours (fill, drain, imbalance)
        pp_comm = steps * (span - span0)  # transfers on the critical path
        pp_alpha = pp_comm * hop_alpha / hop
    tp_comm = steps * mb * slowest.tp_comm
    compute_only = steps * mb * slowest.compute
    # Data parallel: the slowest edge rank's FSDP traffic; hidden behind compute except the
    # first gather and the last reduce-scatter (one module's share). The traffic of a
    # vocabulary split over dp carries activations the next op waits for: all exposed.
    dp_exposed = 0.0
    dp_total = dp_alpha = 0.0
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
            alpha_dp = collective_alpha("all_gather", calls, p.dp, span, hw)
            exposed = max(0.0, t_dp - compute_only) + t_dp / modules
            if p.pp > 1 and p.data_parallel_mode != "fsdp":
                t_dp, exposed = _reduce_after_schedule(cfg, hw, params[r], nbytes, compute_only)
            if vocab:  # embedding: 3 calls, head: 6, per micro-batch
                edges = sum(
                    3 * first + 6 * last for _, first, last in stage_modules(p, m.n_layers, r)
                )
                t_vocab = collective_time("all_gather", vocab, steps * mb * edges, p.dp, span, hw)
                t_dp, exposed = t_dp + t_vocab, exposed + t_vocab
                alpha_dp += collective_alpha("all_gather", steps * mb * edges, p.dp, span, hw)
            if exposed > dp_exposed:
                dp_exposed, dp_total, dp_alpha = exposed, t_dp, alpha_dp
    fixed = max((fixed_parts(cfg, hw, params[r]) for r in ranks), key=lambda f: sum(f.values()))
    kernels = steps * mb * slowest.kernels
    fixed["host_dispatch_s"] = host_dispatch_time(cfg, hw, kernels)
    serial = sum(fixed.values())  # optimizer, clipping, accumulation, casts: in series
    compute = compute_only + serial
    moe_parts = moe_comm_times(cfg, hw, params[0], comm_metrics(cfg)) if is_moe(m) else {}
    moe_comm = sum(v for k, v in moe_parts.items() if not k.endswith("_alpha_s"))
    comm = tp_comm + pp_comm + dp_exposed + moe_comm  # moe's: none overlaps compute
    step = busy + bubble + pp_comm + dp_exposed + serial + moe_comm
    launch = kernels * hw.launch
    alphas = {
        "tp_alpha_s": steps * mb * slowest.tp_alpha,
        "pp_alpha_s": pp_alpha,
        "dp_alpha_s": dp_alpha,
        "ep_alpha_s": moe_parts.get("ep_alpha_s", 0.0),
    }
    # What does not shrink with the micro-batch: the serial terms, the launches, and the
    # latency of the collectives on the critical path (dp's only as far as it is exposed).
    fixed_s = serial + launch + sum(alphas.values()) - dp_alpha + min(dp_alpha, dp_exposed)
    memories = {r: memory_breakdown(cfg, hw, r) for r in ranks}
    worst = max(memories.values(), key=lambda mem: sum(mem.values()))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    per_block = per_block_forward(m, strategy, p.tp, tokens, act_size=a) if strategy else 0
    gemms = block_gemms(m, strategy, p.tp, seqs, cfg.data.seq_len, 1, p.grouping, p.ep)
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
            **fixed,
            "tp_comm_s": tp_comm,
            "pp_comm_s": pp_comm,
            "dp_comm_s": dp_total,
            "dp_comm_exposed_s": dp_exposed,
            "bubble_s": bubble,
            **{k: v for k, v in moe_parts.items() if not k.endswith("_alpha_s")},
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
        moe=planned_moe_summary(cfg, hw, sum(worst.values()), comm_metrics(cfg))
        if is_moe(m)
        else None,
        fixed={
            **fixed,
            "launch_s": launch,
            **alphas,
            "fixed_s": fixed_s,
            "fixed_share": fixed_s / step if step else 0.0,
            "kernels_per_step": kernels,
            "kernel_mode": kernel_mode(cfg),
            "launch_us": hw.launch * 1e6,
            "host_ops_per_step": host_ops(cfg, kernels),
            "host_op_us": hw.host_op_cost * 1e6,
        },
    )


def _all_stage_times(cfg: RunConfig, hw: HardwareProfile) -> list[StageTime]:
    """Every pipeline rank's chunk times (ranks holding the same stage shapes share one)."""
    p, n = cfg.parallel, cfg.model.n_layers
    out, seen = [], {}
    for r in range(p.pp):
        stages = stage_modules(p, n, r)
        shape = tuple((len(ls), ls.start, first, last) for ls, first, last in stages)
        if not arch_spec(cfg.model.arch).crossing:  # only a crossing arch's block 0 differs
            shape = tuple((k, first, last) for k, _, first, last in shape)
        if shape not in seen:
            seen[shape] = stage_time(cfg, hw, r)
        out.append(seen[shape])
    return out


def _reduce_after_schedule(
    cfg: RunConfig, hw: HardwareProfile, params: RankParams, nbytes: int, compute: float
) -> tuple[float, float]:
    """(total, exposed) dp seconds of ``ddp`` mode under a pipeline.

    torch's ``PipelineStage`` keeps the gathered parameters and unreduced gradients through
    every micro-batch and reduce-scatters the whole stage in ``perform_reduce_grad``, after
    the schedule's last backward: nothing is left to hide that reduction behind, so all of
    it is exposed. The one gather per step is prefetched behind the first forward, as
    without a pipeline (its first module's share exposed)."""
    p = cfg.parallel
    _, _, steps = microbatching(cfg)
    modules = [n for n in params.modules if n]
    reduce = fsdp_pipeline_bytes(modules, p.dp, steps, False, p.pp_microbatches, 0)
    span = p.dp * p.tp
    calls = steps * max(1, len(modules))
    t_gather = collective_time("all_gather", nbytes - reduce, calls, p.dp, span, hw)
    t_reduce = collective_time("reduce_scatter", reduce, calls, p.dp, span, hw)
    exposed = max(0.0, t_gather - compute) + t_gather / max(1, len(modules)) + t_reduce
    return t_gather + t_reduce, exposed
