"""``parallel.dp_mode auto`` under a pipeline, decided by the plan (docs/planning.md).

Under a pipeline the two data-parallel modes trade memory for traffic: ``ddp`` keeps the
stage's parameters gathered (in the compute dtype) and its gradients unreduced (fp32) from
the first micro-batch to the step's one reduction, ``fsdp`` gathers and reduces per
pipeline micro-batch and holds only its shards. ``auto`` takes the mode the plan predicts
faster, but ``ddp`` only when the plan's peak for it leaves :data:`MEMORY_MARGIN` of the
device free; otherwise ``fsdp``. The inputs are the config and the device's memory as a
constant of its kind (a profile's, the card's total, the host's RAM over its ranks), never
a rank's measurement, so every rank that resolves a config decides the same.

The bytes a mode holds by construction beyond the sharded state (:func:`mode_held_bytes`)
are also each mode's floor in the metrics (``mem_floor_ddp_mb``, ``mem_floor_fsdp_mb``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from boostlr.analysis.chunktime import act_size
from boostlr.analysis.costmodel import comm_metrics, memory_breakdown, planning_config, predict
from boostlr.analysis.hardware import HardwareProfile
from boostlr.analysis.memory import FP32, rank_params
from boostlr.config import RunConfig

MODES = ("fsdp", "ddp")
# Fraction of the device the plan's peak must leave free for ``auto`` to keep the stage
# gathered: the plan models tensors, not the allocator's fragmentation or a library's
# workspace, and running out of memory costs the run.
MEMORY_MARGIN = 0.15
GIB = 1 << 30


@dataclass(frozen=True)
class DpModeChoice:
    """What ``auto`` resolved to under a pipeline, and the plan's figures behind it."""

    mode: str
    reason: str
    peak: dict[str, float]  # the plan's peak bytes per rank, per mode (the fullest pp rank)
    speed: dict[str, float]  # per mode: predicted step seconds, or dp bytes without a profile
    memory: float  # the device's bytes the decision used
    memory_source: str  # where that figure came from (a profile, the card, the host)

    @property
    def limit(self) -> float:
        """The most bytes ``ddp``'s planned peak may take."""
        return memory_limit(self.memory)

    def line(self) -> str:
        """The start-up line: which mode and why."""
        return f"parallel.dp_mode auto -> {self.mode}: {self.reason}"


def memory_limit(memory: float) -> float:
    """The most bytes ``ddp``'s planned peak may take of a device's ``memory``."""
    return (1.0 - MEMORY_MARGIN) * memory


def with_mode(cfg: RunConfig, mode: str) -> RunConfig:
    """``cfg`` with ``parallel.dp_mode`` set (a plain copy; ``cfg`` is not written)."""
    parallel = dataclasses.replace(cfg.parallel, dp_mode=mode)
    return RunConfig(model=cfg.model, data=cfg.data, train=cfg.train, parallel=parallel)


def planned_peak(cfg: RunConfig, hw: HardwareProfile | None) -> float:
    """The plan's peak bytes on the fullest pp rank (with the profile's reserve, if any)."""
    ranks = sorted({0, cfg.parallel.pp - 1})
    return max(sum(memory_breakdown(cfg, hw, r).values()) for r in ranks)


def choose_dp_mode(
    cfg: RunConfig, memory: float, hw: HardwareProfile | None, memory_source: str
) -> DpModeChoice:
    """Decide ``auto`` for a pipeline layout with data parallelism (``pp > 1``, ``dp > 1``).

    ``memory``: the bytes one rank's device has (see the module's docstring); ``hw``: the
    profile whose predicted step times rank the modes, or ``None``, which ranks them by the
    plan's dp bytes per step (the ``ddp`` saving, hardware-free).
    """
    cfg = planning_config(cfg)
    peak, speed = {}, {}
    for mode in MODES:
        variant = with_mode(cfg, mode)
        peak[mode] = planned_peak(variant, hw)
        if hw is not None:
            speed[mode] = predict(variant, hw).step_time
        else:
            speed[mode] = float(
                max(comm_metrics(variant, r)["comm_dp_bytes"] for r in {0, cfg.parallel.pp - 1})
            )
    limit = memory_limit(memory)
    unit = "s step" if hw is not None else " dp bytes a step"
    figures = f"{speed['ddp']:.4g}{unit} vs fsdp's {speed['fsdp']:.4g}"
    budget = (
        f"{limit / GIB:.1f} GiB ({1 - MEMORY_MARGIN:.0%} of {memory / GIB:.1f} GiB, "
        f"{memory_source})"
    )
    if peak["ddp"] > limit:
        mode = "fsdp"
        reason = (
            f"the plan's ddp peak {peak['ddp'] / GIB:.2f} GiB is over {budget}; "
            f"fsdp's is {peak['fsdp'] / GIB:.2f} GiB"
        )
    elif speed["ddp"] < speed["fsdp"]:
        mode = "ddp"
        reason = f"the plan's ddp peak {peak['ddp'] / GIB:.2f} GiB fits {budget}; {figures}"
    else:
        mode = "fsdp"
        reason = f"ddp fits ({peak['ddp'] / GIB:.2f} GiB of {budget}) but is no faster: {figures}"
    return DpModeChoice(mode, reason, peak, speed, memory, memory_source)


def mode_held_bytes(cfg: RunConfig, pp_rank: int, tp_rank: int = 0) -> dict[str, float]:
    """Bytes each dp mode holds by construction beyond the sharded parameters, gradients and
    optimizer state: nothing for ``fsdp``; for ``ddp`` the gathered parameters in the
    gather dtype (every FSDP unit stays gathered from forward to backward; the dp-split
    vocabulary and experts held whole are never gathered), and under a pipeline also their
    unreduced fp32 gradients (torch's stage reduces once, after the last micro-batch)."""
    cfg = planning_config(cfg)
    p, m = cfg.parallel, cfg.model
    if p.dp == 1:
        return dict.fromkeys(MODES, 0.0)
    params = rank_params(m, p.strategy_for(m.arch), p, pp_rank, tp_rank)
    whole = 0 if params.expert_units else params.experts
    gathered = params.local - params.vocab_local - whole
    ddp = act_size(cfg) * gathered + (FP32 * gathered if p.pp > 1 else 0)
    return {"fsdp": 0.0, "ddp": float(ddp)}
