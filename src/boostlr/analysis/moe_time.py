"""The cost model's MoE step terms: the ep all-to-alls' and the expert units' dp_rep time,
and the plan's MoE summary (receive bound, memory at the bound).

Kept beside :mod:`boostlr.analysis.costmodel`, which calls them with its own per-rank byte
metrics (so this module does not import the cost model back).
"""

from __future__ import annotations

from boostlr.analysis.chunktime import act_size, collective_alpha, collective_time, microbatching
from boostlr.analysis.hardware import HardwareProfile
from boostlr.analysis.memory import RankParams, in_flight, stage_modules
from boostlr.analysis.moe import dp_rep, ep_micro_calls, expert_grad_calls, moe_summary
from boostlr.config import RunConfig
from boostlr.specs.moe import moe_layer_count


def planned_moe_summary(
    cfg: RunConfig, hw: HardwareProfile, memory: float, metrics: dict[str, int]
) -> dict[str, object]:
    """:func:`moe_summary` of a planning config: its ep bytes (``metrics``, the cost model's
    comm_metrics) and its receive bound over the MoE layers whose activations are alive at
    pipeline rank 0's peak."""
    p, m = cfg.parallel, cfg.model
    held = 1
    if p.act_ckpt == "none":
        layers = sum(moe_layer_count(m, ls) for ls, _, _ in stage_modules(p, m.n_layers, 0))
        held = layers * in_flight(p, 0)
    # The tokens a rank dispatches: under BTP its TP rank's share of the micro-batch.
    tokens = cfg.train.batch_size * cfg.data.seq_len // p.tp
    ep_bytes = metrics["comm_ep_bytes"]
    return moe_summary(m, p, ep_bytes, tokens, act_size(cfg), held, memory, hw.memory)


def moe_comm_times(
    cfg: RunConfig, hw: HardwareProfile, params: RankParams, metrics: dict[str, int]
) -> dict[str, float]:
    """Seconds of an MoE step's ep all-to-alls and of the expert units' FSDP traffic over
    dp_rep. The all-to-alls are exposed: each one's result is the next op's input. The
    expert units overlap compute as the blocks' FSDP traffic does, bar one unit's share
    (the first gather, the last reduce-scatter): that share is exposed."""
    p, m = cfg.parallel, cfg.model
    seqs, mb, steps = microbatching(cfg)
    calls = steps * mb * ep_micro_calls(m, p)
    ep = collective_time("all_to_all", metrics["comm_ep_bytes"], calls, p.ep, p.ep * p.tp, hw)
    units = len(params.expert_units)
    rep_calls = expert_grad_calls(p, units, steps, mb)
    rep = collective_time(
        "all_gather", metrics["comm_dp_rep_bytes"], rep_calls, dp_rep(p), p.dp * p.tp, hw
    )
    return {
        "ep_comm_s": ep,
        "dp_rep_comm_s": rep / units if units else 0.0,
        "ep_alpha_s": collective_alpha("all_to_all", calls, p.ep, p.ep * p.tp, hw),
    }
