"""What ``boostlr plan`` reports for one configuration, and its JSON row (a contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from boostlr.config import RunConfig


@dataclass
class Prediction:
    """Everything ``boostlr plan`` reports for one configuration."""

    arch: str
    strategy: str | None
    layout: dict[str, Any]
    step_time: float
    compute: float  # GEMMs, element-wise, recompute, optimizer (busy time on the critical path)
    comm: float  # exposed communication: tp + pp + the dp not hidden behind compute
    bubble: float
    parts: dict[str, float]
    memory: dict[str, float]
    fits: bool
    comm_bytes: dict[str, int]
    tp_bytes_fwd_per_block: int
    gemms: list[dict[str, Any]] = field(default_factory=list)
    flops_per_rank: float = 0.0
    moe: dict[str, Any] | None = None  # an MoE model's routing figures (moe_summary)
    # The step's fixed costs (analysis/fixed.py) and the launch and α shares, seconds; the
    # kernel count per step and whether it assumes eager or compiled kernels.
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    def row(self) -> dict[str, Any]:
        """The JSON row (contract: add fields freely, never rename)."""
        inten = [g["intensity"] for g in self.gemms if g["kind"] == "linear"]
        weighted = sum(g["intensity"] * g["flops"] for g in self.gemms if g["kind"] == "linear")
        total = sum(g["flops"] for g in self.gemms if g["kind"] == "linear")
        return {
            "arch": self.arch,
            "strategy": self.strategy,
            "step_time_s": self.step_time,
            "compute_s": self.compute,
            "comm_s": self.comm,
            "bubble_s": self.bubble,
            "tp_bytes_fwd_per_block": self.tp_bytes_fwd_per_block,
            "memory_gb": self.memory_total / 1e9,
            "fits": self.fits,
            "gemm_intensity_min": min(inten) if inten else 0.0,
            "gemm_intensity_mean": weighted / total if total else 0.0,
            "parts_s": self.parts,
            "memory_parts_gb": {k: v / 1e9 for k, v in self.memory.items()},
            "comm_bytes_per_step": self.comm_bytes,
            "flops_per_rank": self.flops_per_rank,
            "layout": self.layout,
            "fixed": self.fixed,
            **({"moe": self.moe} if self.moe is not None else {}),
        }


def planned_layout(cfg: RunConfig) -> dict[str, Any]:
    """The layout and batch a prediction is for (a JSON row field; a checkpoint records its
    own layout with :func:`boostlr.rundir.payload.layout_of`)."""
    p, t = cfg.parallel, cfg.train
    return {
        "gpus": p.world_size,
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "dp_mode": p.data_parallel_mode,
        "vocab_dp": p.vocab_dp,  # resolved (planning_config): auto shows what it decided
        "pp_schedule": p.pp_schedule if p.pp > 1 else None,
        "microbatches": p.pp_microbatches if p.pp > 1 else 1,
        "pp_virtual": p.virtual_stages,
        "act_ckpt": p.act_ckpt,
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "global_batch": t.batch_size * t.grad_accum * p.dp,
        "seq_len": cfg.data.seq_len,
        "dtype": t.dtype,
        **({"ep": p.ep} if cfg.model.moe_experts else {}),
    }
