"""Traced ranks beside the plan: peak tensor bytes, traffic, and the CUDA-only extras.

The plan's numbers for a traced rank are its pipeline rank's memory breakdown
(:func:`boostlr.analysis.costmodel.memory_breakdown`, tensor terms only: the profile's lumped
``reserved`` is left out) and that rank's traffic (:func:`~boostlr.analysis.costmodel.
comm_metrics`), both per optimizer step.

Fake tensors see every tensor a rank holds, but not what CUDA itself holds beside them. Those
terms are separate and named, each from a public figure (none fitted to a measurement):

* ``cuda_context``: the CUDA context (the driver's per-process state, kernels of the CUDA
  libraries loaded on demand). :data:`CUDA_CONTEXT_BYTES` is an assumption of the order
  NVIDIA's "CUDA Lazy Loading" documentation (CUDA C++ Programming Guide, lazy loading,
  default since CUDA 12.2) describes; no GPU checked it here.
* ``nccl_buffers``: NCCL's staging buffers, per communicator ``channels x 2 (send, recv) x
  NCCL_BUFFSIZE`` (NCCL user guide, "Environment Variables": NCCL_BUFFSIZE defaults to
  4 MiB; :data:`NCCL_CHANNELS` is an assumed typical channel count on NVLink). One
  communicator per process group of more than one rank (world, tp, dp, pp) plus the two
  2-rank communicators torch's pipeline schedules warm up for point-to-point.
* ``allocator_rounding``: the CUDA caching allocator's rounding of the blocks live at the
  peak (:func:`boostlr.trace.counter.allocator_size`), computed from the trace.
  Fragmentation between blocks is not modelled.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from boostlr.analysis.costmodel import comm_metrics, memory_breakdown, planning_config
from boostlr.analysis.hardware import HardwareProfile
from boostlr.config import RunConfig
from boostlr.trace.moe_routing import ASSUMPTION
from boostlr.trace.rank import RankTrace

MIB = 1 << 20
GIB = 1 << 30
CUDA_CONTEXT_BYTES = 500 * MIB  # assumption, see the module docstring
NCCL_BUFFSIZE = 4 * MIB  # NCCL's documented default
NCCL_CHANNELS = 16  # assumption: a typical NVLink channel count


def communicators(cfg: RunConfig) -> int:
    """NCCL communicators one rank creates: each group of more than one rank, and p2p."""
    p = cfg.parallel
    groups = [p.world_size, p.tp, p.dp, p.pp]
    if p.ep > 1:  # the experts' view of dp: its ep and dp_rep groups
        groups += [p.ep, p.dp // p.ep]
    return sum(1 for g in groups if g > 1) + (2 if p.pp > 1 else 0)


def cuda_extras(cfg: RunConfig, t: RankTrace) -> dict[str, int]:
    """The named bytes CUDA holds beside a traced rank's tensors."""
    return {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "nccl_buffers": communicators(cfg) * NCCL_CHANNELS * 2 * NCCL_BUFFSIZE,
        "allocator_rounding": max(0, t.peak_rounded - t.peak_bytes),
    }


def plan_for(cfg: RunConfig, hw: HardwareProfile, t: RankTrace) -> dict[str, Any]:
    """The plan's memory breakdown and traffic for the traced rank's position."""
    breakdown = memory_breakdown(cfg, hw, t.pp_stage)
    comm = comm_metrics(cfg, t.pp_stage, t.tp_rank)
    groups = {"tp": comm["comm_tp_bytes"], "dp": comm["comm_dp_bytes"], "pp": comm["comm_pp_bytes"]}
    if cfg.parallel.ep > 1:  # MoE at ep > 1: the groups a traced rank reports (RankTrace)
        groups["ep"] = comm["comm_ep_bytes"]
        if comm["comm_dp_rep_bytes"]:
            groups["dp_rep"] = comm["comm_dp_rep_bytes"]
    return {
        "memory": {k: int(v) for k, v in breakdown.items()},
        "peak_bytes": int(sum(v for k, v in breakdown.items() if k != "reserved")),
        "comm_bytes": groups,
    }


def collective_summary(t: RankTrace) -> list[dict[str, Any]]:
    """Step 2's collectives grouped by (group, op, tag, phase): calls and bytes."""
    sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in t.records:
        key = (r["group"], r["op"], r["tag"], r["phase"])
        sums[key][0] += 1
        sums[key][1] += r["bytes"]
    return [
        {"group": g, "op": op, "tag": tag, "phase": ph, "calls": c, "bytes": b}
        for (g, op, tag, ph), (c, b) in sorted(sums.items())
    ]


def trace_json(cfg: RunConfig, hw: HardwareProfile, traces: list[RankTrace]) -> list[dict]:
    """The ``trace`` list of ``plan --trace --json``: one object per traced rank."""
    cfg = planning_config(cfg)
    out = []
    moe = {"routing": ASSUMPTION} if cfg.model.moe_experts else {}
    for t in traces:
        plan = plan_for(cfg, hw, t)
        extras = cuda_extras(cfg, t)
        out.append(
            {
                **moe,
                "rank": t.rank,
                "pp_stage": t.pp_stage,
                "dp_rank": t.dp_rank,
                "tp_rank": t.tp_rank,
                "peak_bytes": t.peak_bytes,
                "peak_bytes_by_phase": t.peaks,
                "plan_peak_bytes": plan["peak_bytes"],
                "plan_memory": plan["memory"],
                "cuda_extras": extras,
                "device_bytes": t.peak_bytes + sum(extras.values()),
                "held_after_step_bytes": t.held_after,
                "comm_bytes": t.comm_bytes(),
                "plan_comm_bytes": plan["comm_bytes"],
                "steps_equal": t.steps_equal,
                "host_rss_bytes": t.host_rss_bytes,
                "wall_s": round(t.wall_s, 1),
                # micro-batches run per step; the schedule repeats the last for the rest
                "micro_batches_run": t.micro_run,
                "collectives": collective_summary(t),
                # Step 2's ledger in the order it was issued (point-to-point included): the
                # schedule the plan's pipeline terms are derived from.
                "schedule": [dict(r) for r in t.records],
            }
        )
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}" if n >= 0.1 * GIB or n == 0 else f"{n / GIB:.4f}"


def _diff(traced: float, planned: float) -> str:
    if not traced:
        return "-" if not planned else "inf"
    return f"{100 * (planned - traced) / traced:+.1f}%"


def format_trace(entries: list[dict]) -> str:
    """The text table printed under the plan's rows."""
    lines = [
        "",
        "traced ranks (fake tensors, fake process group; bytes per rank, GiB; traffic per step)",
        f"{'rank':>5} {'pp':>3} {'dp':>3} {'tp':>3} | {'build':>6} {'fwd':>6} {'bwd':>6} "
        f"{'optim':>6} {'step2':>6} | {'peak':>6} {'plan':>6} {'diff':>7} | "
        f"{'+cuda':>6} {'device':>6}",
    ]
    for e in entries:
        ph = e["peak_bytes_by_phase"]
        extras = sum(e["cuda_extras"].values())
        lines.append(
            f"{e['rank']:>5} {e['pp_stage']:>3} {e['dp_rank']:>3} {e['tp_rank']:>3} | "
            + " ".join(
                f"{_gib(ph[k]):>6}" for k in ("build", "forward", "backward", "optimizer", "step2")
            )
            + f" | {_gib(e['peak_bytes']):>6} {_gib(e['plan_peak_bytes']):>6} "
            f"{_diff(e['peak_bytes'], e['plan_peak_bytes']):>7} | "
            f"{_gib(extras):>6} {_gib(e['device_bytes']):>6}"
        )
    lines.append("")
    lines.append(f"{'rank':>5} {'group':>5} | {'traced bytes':>16} {'plan bytes':>16} {'diff':>7}")
    for e in entries:
        for g in dict.fromkeys([*e["comm_bytes"], *e["plan_comm_bytes"]]):
            traced, planned = e["comm_bytes"].get(g, 0), e["plan_comm_bytes"].get(g, 0)
            if traced or planned:
                lines.append(
                    f"{e['rank']:>5} {g:>5} | {traced:>16,} {planned:>16,} "
                    f"{_diff(traced, planned):>7}"
                )
    extras = entries[0]["cuda_extras"] if entries else {}
    if extras:
        named = ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in extras.items())
        lines.append(f"\n+cuda (rank {entries[0]['rank']}): {named}")
    if entries and "routing" in entries[0]:
        lines.append(entries[0]["routing"])
    return "\n".join(lines)
