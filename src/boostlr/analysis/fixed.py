"""A step's fixed costs: what it pays whatever the micro-batch size (issue 47).

At one sequence per micro-batch a rank's GEMMs are short, and the work that does not shrink
with the tokens becomes a visible share of the step. Each term is costed from physics with the
profile's constants (each with its public source in the profile's comments):

* the optimizer step: fused AdamW, one pass over the fp32 master weights, gradients and both
  moments (read p, g, m, v; write p, m, v: 28 bytes per parameter) at the card's streaming
  bandwidth (``stream_efficiency``), one kernel per parameter group;
* gradient clipping: ``_foreach_norm`` (read g) and ``clip_grads_with_norm_``'s
  ``_foreach_mul_`` (read and write g), and the norm's scalar all-reduce over every mesh dim;
* zeroing: ``zero_grad(set_to_none=True)`` frees the gradients (no pass); the first
  micro-batch's backward writes them fresh and every later one adds into them (read both,
  write one: 12 bytes per gradient element);
* the weight casts of bf16 autocast: each weight read in fp32 and written in bf16 once per
  forward (again in a recompute), its bf16 gradient cast back to fp32 in the backward (6 bytes
  each way); FSDP's mixed precision casts the shard before the gather instead;
* kernel launches (the profile's ``launch_us`` per kernel, eager or compiled as
  ``train.compile`` says) and collective latency (α), both already inside the chunk and
  collective times: reported as their share;
* the host's dispatch beyond the launches: eager PyTorch dispatches about twice as many
  aten ops as it launches kernels (views, wrappers, casts to a tensor's own dtype; more
  under BTP and bf16: ``specs.strategy.host_ops_per_kernel``), and each costs the host
  ``host_op_us`` (Python, the dispatcher, autograd's record) whether or not it launches. The
  host's time for the step's ops, less the launches already charged, is added in series:
  where a step is host-bound (one short sequence per micro-batch, or any step on a CPU) the
  device waits for it. Under ``train.compile`` a region is one graph call: no term.
"""

from __future__ import annotations

from boostlr.analysis.chunktime import collective_alpha, microbatching, stream_time
from boostlr.analysis.hardware import HardwareProfile
from boostlr.analysis.memory import RankParams
from boostlr.config import RunConfig
from boostlr.specs.strategy import host_ops_per_kernel

# fp32 bytes per parameter, every operand read and every result written once
# (tests/test_costmodel.py checks torch dispatches these ops):
FUSED_ADAMW_BYTES = 28  # one kernel: read p, g, m, v; write p, m, v
CLIP_PASSES = (4, 8)  # _foreach_norm (read g), then clip_grads_with_norm_'s _foreach_mul_
ACCUMULATE_BYTES = 12  # grad += new: read both, write one (fp32)
CAST_BYTES = 6  # fp32 -> bf16 (read 4, write 2), or back
ADAMW_GROUPS = 2  # build_optimizer: matrices (decay) and the rest


def _shard(cfg: RunConfig, params: RankParams) -> int:
    """Elements the optimizer steps on this rank (FSDP shards them over dp)."""
    return params.sharded if cfg.parallel.dp > 1 else params.local


def optimizer_time(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> float:
    """Fused AdamW on one rank's shard: one pass, one kernel per parameter group."""
    return stream_time(FUSED_ADAMW_BYTES * _shard(cfg, params), hw, ADAMW_GROUPS)


def clip_time(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> float:
    """The gradient norm (computed even unclipped: it is logged), the scale when clipping,
    and the norm's scalar all-reduce over every mesh dim of size > 1."""
    p = cfg.parallel
    passes = CLIP_PASSES if cfg.train.grad_clip > 0 else CLIP_PASSES[:1]
    out = stream_time(sum(passes) * _shard(cfg, params), hw, len(passes))
    for size, span in ((p.tp, p.tp), (p.dp, p.tp * p.dp), (p.pp, p.world_size)):
        out += collective_alpha("all_reduce", 1, size, span, hw)  # 4 bytes: all latency
    return out


def accumulation_time(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> float:
    """Gradient accumulation after ``set_to_none`` zeroing: every backward after a step's
    first adds into the held gradients (FSDP: into the sharded ones after each
    reduce-scatter; ``ddp`` under a pipeline: the stage's unsharded ones)."""
    p = cfg.parallel
    _, mb, steps = microbatching(cfg)
    backwards = steps * mb
    if backwards <= 1:
        return 0.0
    # FSDP reduce-scatters after every backward (so the sharded gradients accumulate),
    # except ``ddp`` under a pipeline, which holds the stage's unsharded ones to the end.
    unsharded = p.dp == 1 or (p.pp > 1 and p.data_parallel_mode != "fsdp")
    held = params.local if unsharded else params.sharded
    return stream_time(ACCUMULATE_BYTES * held * (backwards - 1), hw)


def cast_time(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> float:
    """bf16 autocast's weight casts per step (nothing in fp32).

    Without data parallelism every weight is cast in each forward (and each recompute of
    its block) and its gradient cast back in each backward. Under FSDP's mixed precision
    the shard is cast before each all-gather and the full bf16 gradient cast to fp32 before
    each gradient reduction (the gathers ``comm.fsdp_bytes`` counts)."""
    p = cfg.parallel
    if cfg.train.dtype != "bfloat16":
        return 0.0
    _, mb, steps = microbatching(cfg)
    backwards = steps * mb
    if p.dp == 1:
        forwards = backwards * (2 if p.act_ckpt != "none" else 1)
        return stream_time(CAST_BYTES * params.local * (forwards + backwards), hw)
    fsdp = p.data_parallel_mode == "fsdp"
    if p.pp == 1:  # gathered in every forward, and again in the backward when resharded
        gathers = backwards * (2 if fsdp else 1)
    else:  # fsdp: per pipeline micro-batch, both ways; ddp: once per schedule step
        gathers = backwards * 2 if fsdp else steps
    return stream_time(CAST_BYTES * (params.sharded * gathers + params.local * backwards), hw)


def fixed_parts(cfg: RunConfig, hw: HardwareProfile, params: RankParams) -> dict[str, float]:
    """The serial per-step terms, seconds (``zero_grad_s`` is 0: gradients are freed)."""
    return {
        "optimizer_s": optimizer_time(cfg, hw, params),
        "clip_s": clip_time(cfg, hw, params),
        "zero_grad_s": 0.0,
        "grad_accumulation_s": accumulation_time(cfg, hw, params),
        "weight_cast_s": cast_time(cfg, hw, params),
    }


def kernel_mode(cfg: RunConfig) -> str:
    """What the launch count assumes: ``compiled`` (``train.compile``) or ``eager``."""
    return "compiled" if cfg.train.compile else "eager"


def host_ops(cfg: RunConfig, kernels: int) -> float:
    """Aten ops the host dispatches for ``kernels`` planned kernels (eager), 0 compiled."""
    if cfg.train.compile:
        return 0.0
    strategy = cfg.parallel.strategy_for(cfg.model.arch) if cfg.parallel.tp > 1 else None
    return kernels * host_ops_per_kernel(strategy, cfg.train.dtype)


def host_dispatch_time(cfg: RunConfig, hw: HardwareProfile, kernels: int) -> float:
    """Host seconds of a step's dispatch beyond the per-kernel launches already charged."""
    return max(0.0, host_ops(cfg, kernels) * hw.host_op_cost - kernels * hw.launch)
