"""``boostlr plan``: the cost model's prediction for a config (or a layout search), with
``--trace`` beside it and ``--plot`` after it; the tracing flags' checks live here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from boostlr.cli.common import Call, Command
from boostlr.errors import BoostlrError


def add_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="predict step time, traffic and memory of full/vanilla/btp, or search layouts",
        description="Cost model (no GPU, nothing allocated). Config and --section.key VALUE "
        "overrides as for train.",
    )
    pl.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    pl.add_argument("--hardware", required=True, help="profile name or path to a .toml file")
    pl.add_argument("--gpus", type=int, default=None, help="world size (fills parallel.dp -1)")
    pl.add_argument("--search", action="store_true", help="rank every valid layout of --gpus")
    pl.add_argument("--top", type=int, default=5, help="layouts to print with --search")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.add_argument(
        "--trace",
        action="store_true",
        help="also run one rank of each role for two real steps on fake tensors and a fake "
        "process group of --gpus ranks: peak tensor bytes and every collective, beside the plan",
    )
    pl.add_argument(
        "--trace-rank",
        type=int,
        action="append",
        metavar="RANK",
        help="with --trace: trace only this global rank (repeat for more) instead of one of "
        "each role",
    )
    pl.add_argument(
        "--trace-jobs",
        type=int,
        metavar="N",
        help="with --trace: ranks traced at once (default: one per CPU core)",
    )
    pl.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also draw step-time breakdown, 1-256 GPU scaling and 1B-40B weak scaling "
        "(needs matplotlib: the 'plot' extra)",
    )


def check_trace_flags(
    trace: bool, search: bool, gpus: int | None, ranks: list[int] | None, jobs: int | None
) -> None:
    """``plan``'s tracing flags, each misuse refused in one line."""
    if search and trace:
        raise BoostlrError("--trace traces the config's own layout: drop --search")
    if ranks is not None and not trace:
        raise BoostlrError("--trace-rank picks the ranks --trace traces: add --trace")
    if jobs is not None and (not trace or jobs < 1):
        raise BoostlrError(
            "--trace-jobs N sets how many ranks --trace runs at once: N >= 1, with --trace"
        )
    if trace and not gpus:
        raise BoostlrError("--trace needs --gpus N: the world size to trace")


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.analysis import plan
    from boostlr.analysis.hardware import load_profile
    from boostlr.config import parse_overrides
    from boostlr.plots.plan import plan_json, print_rows, search_json

    if args.plot:
        from boostlr.plots import require_matplotlib

        require_matplotlib("--plot")
    hw = load_profile(args.hardware)
    cfg = plan.load_config(args.config, parse_overrides(call.overrides), args.gpus, args.search)
    if args.plot and cfg.model.moe_experts:
        raise BoostlrError(
            f"plan --plot does not draw MoE models yet (model.moe_experts "
            f"{cfg.model.moe_experts}): drop --plot (plan, --search and --trace cover MoE)"
        )
    check_trace_flags(args.trace, args.search, args.gpus, args.trace_rank, args.trace_jobs)
    if args.search:
        cands = plan.search(cfg, hw, args.gpus, args.top)
        if args.json:
            print(json.dumps(search_json(cands, hw, args.gpus), indent=2))
        else:
            preds = [c.prediction for c in cands]
            print_rows(preds, hw, f"best layouts of {args.gpus} x {hw.name}")
            print_fixed(preds)
    else:
        rows = plan.strategy_rows(cfg, hw)
        traced = None
        if args.trace:
            from boostlr.trace.compare import trace_json
            from boostlr.trace.run import trace

            traced_cfg = plan.as_trained(cfg, hw)[0]  # the dp_mode a run would take
            traced = trace_json(traced_cfg, hw, trace(traced_cfg, args.trace_rank, args.trace_jobs))
        if args.json:
            out = plan_json(rows, hw, cfg)
            if traced is not None:
                out["trace"] = traced
            print(json.dumps(out, indent=2))
        else:
            print_rows(rows, hw, f"{cfg.model.preset} on {hw.name}")
            print_dp_auto(rows)
            print_fixed(rows)
            if traced is not None:
                from boostlr.trace.compare import format_trace

                print(format_trace(traced))
    if args.plot:
        from boostlr.plots.plan import draw, plot_data

        draw(plot_data(cfg, hw, args.gpus if args.search else None), Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)


FIXED_DOMINATE = 0.5  # a row whose fixed costs exceed this share of its step is "dominated"
FIXED_TERMS = (  # (key of Prediction.fixed, label)
    ("optimizer_s", "AdamW"),
    ("clip_s", "clip"),
    ("zero_grad_s", "zero_grad"),
    ("grad_accumulation_s", "grad accum"),
    ("weight_cast_s", "bf16 casts"),
    ("launch_s", "launches"),
    ("host_dispatch_s", "host dispatch"),
    ("tp_alpha_s", "tp α"),
    ("pp_alpha_s", "pp α"),
    ("dp_alpha_s", "dp α"),
    ("ep_alpha_s", "ep α"),
)


def print_dp_auto(rows: list) -> None:
    """Which data-parallel mode ``auto`` takes in each row, and why (the trainer's rule)."""
    for r in rows:
        reason = r.layout.get("dp_mode_auto")
        if reason:
            form = f"{r.moe['dispatch']} dispatch" if r.moe else r.strategy or "(tp 1)"
            name = f"{r.arch} {form}"
            print(f"parallel.dp_mode auto -> {r.layout['dp_mode']} ({name}): {reason}")


def print_fixed(rows: list) -> None:
    """Each row's fixed per-step costs (``analysis/fixed.py``): what does not shrink with
    the micro-batch, and its share of the step."""
    if not rows or not rows[0].fixed:
        return
    mode = rows[0].fixed["kernel_mode"]
    print(
        f"fixed costs per step (seconds; {mode} kernels at "
        f"{rows[0].fixed['launch_us']:.1f} µs each, {rows[0].fixed['host_op_us']:.1f} µs of "
        "host per dispatched op, train.compile decides):"
    )
    for r in rows:
        f = r.fixed
        terms = ", ".join(f"{label} {f[k]:.4f}" for k, label in FIXED_TERMS if f.get(k))
        print(
            f"  {r.arch} {r.strategy or '(tp 1)'}: {f['fixed_s']:.3f} s = "
            f"{100 * f['fixed_share']:.0f}% of the step ({terms}; "
            f"{f['kernels_per_step']} kernels, {f['host_ops_per_step']:.0f} host ops)"
        )
    dominated = [r for r in rows if r.fixed["fixed_share"] > FIXED_DOMINATE]
    if dominated:
        worst = max(r.fixed["fixed_share"] for r in dominated)
        print(
            f"fixed costs dominate {len(dominated)} of {len(rows)} rows (up to "
            f"{100 * worst:.0f}% of the step): the ranking there is set by launches, host "
            "dispatch, latency and the optimizer, not by the strategies' GEMMs and traffic; a "
            "larger train.batch_size (or train.compile) amortizes them"
        )


COMMAND = Command("plan", add_parser, run, takes_overrides=True)
