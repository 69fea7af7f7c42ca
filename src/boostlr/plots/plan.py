"""``boostlr plan``'s views of the cost model: its JSON, its table, and with ``--plot`` three
figures of a config as one PNG (the layout searches are :mod:`boostlr.analysis.plan`'s; this
module only presents them).

(a) **Step-time breakdown** per strategy (dense ``full`` + ``megatron``, the config's low-rank
    arch under ``vanilla`` and ``btp``): compute, exposed communication and pipeline bubble, at
    the config's layout (with ``--search``: at the fastest fitting layout of ``--gpus`` for
    each strategy).
(b) **Strong scaling** from 1 to 256 GPUs (powers of two): tokens/s at the fastest fitting
    layout per GPU count, found by the same enumeration as ``--search``. The global batch is
    fixed for the whole curve at the config's, rounded up to a multiple of
    ``256 x train.batch_size`` so that every GPU count, up to pure data parallelism on 256,
    has layouts to choose from.
(c) **Weak scaling** across the presets 1B -> 40B on the BOOST paper's GPU counts (1B on 1,
    3B on 2, 7B on 4, 13B on 8, 30B on 16: about one GPU per 1.5-2B parameters; its series
    ends with 40B on 64), with the sequences per GPU per step fixed at the
    config's (its global batch over its GPUs, rounded up to a multiple of ``batch_size``);
    step time at the fastest fitting layout.

Each strategy line picks its own best layout; TP 1 (the plain model, no TP strategy) counts
for every line, so the vanilla and btp lines meet where TP does not pay. Everything is
arithmetic on shapes (meta device), like the rest of ``plan``; the whole figure is a few
dozen layout searches (about 10 s on one CPU core), so the search space is ``--search``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from boostlr.analysis.costmodel import Prediction
from boostlr.analysis.hardware import HardwareProfile, as_dict
from boostlr.analysis.plan import (
    Candidate,
    best_layouts,
    families,
    search_form,
    strategy_rows,
    with_preset,
)
from boostlr.config import RunConfig
from boostlr.errors import BoostlrError, ConfigError
from boostlr.specs.strategy import REFERENCE, strategy_spec

SCALING_GPUS = tuple(2**i for i in range(9))  # 1 .. 256
WEAK_SCALING = (("1B", 1), ("3B", 2), ("7B", 4), ("13B", 8), ("30B", 16), ("40B", 64))
REF = REFERENCE.name  # the strategy the speed-up divides by and whose layouts are labelled


def _point(c: Candidate | None) -> dict[str, Any] | None:
    if c is None:
        return None
    p = c.prediction
    lay = p.layout
    return {
        "step_time_s": p.step_time,
        "tokens_per_s": lay["global_batch"] * lay["seq_len"] / p.step_time,
        "strategy": p.strategy,
        "layout": lay,
        "overrides": c.overrides,
    }


def _breakdown(p: Prediction) -> dict[str, Any]:
    return {
        "arch": p.arch,
        "strategy": p.strategy,
        "compute_s": p.compute,
        "comm_s": p.comm,
        "bubble_s": p.bubble,
        "step_time_s": p.step_time,
        "fits": p.fits,
        "layout": p.layout,
    }


def plot_data(
    cfg: RunConfig,
    hw: HardwareProfile,
    search_gpus: int | None = None,
    gpu_counts: Iterable[int] = SCALING_GPUS,
    weak: Iterable[tuple[str, int]] = WEAK_SCALING,
) -> dict[str, Any]:
    """Every number the figure shows (JSON-friendly). ``cfg`` is the config ``plan`` built:
    at its own layout, or in search form when ``search_gpus`` is given."""
    fams = families(cfg)
    if search_gpus:
        best = best_layouts(cfg, hw, search_gpus)
        breakdown = []
        for arch, strategy in fams:
            c = best[strategy]
            row = _breakdown(c.prediction) if c else {"arch": arch, "strategy": strategy}
            breakdown.append({**row, "line": strategy})
    else:
        rows = strategy_rows(cfg, hw)
        breakdown = [{**_breakdown(p), "line": s} for p, (_, s) in zip(rows, fams, strict=True)]

    t, p = cfg.train, cfg.parallel
    config_batch = t.batch_size * t.grad_accum * p.dp
    counts = list(gpu_counts)
    quantum = max(counts) * t.batch_size
    global_batch = math.ceil(config_batch / quantum) * quantum
    per_gpu = math.ceil(config_batch / p.world_size / t.batch_size) * t.batch_size
    scaling: dict[str, list[dict[str, Any] | None]] = {s: [] for _, s in fams}
    for n in counts:
        try:
            best = best_layouts(search_form(cfg, n, global_batch), hw, n)
        except ConfigError:  # e.g. n not a multiple of the profile's GPUs per node
            best = {}
        for _, s in fams:
            scaling[s].append(_point(best.get(s)))

    weak_rows = []
    for preset, n in weak:
        try:
            best = best_layouts(search_form(with_preset(cfg, preset), n, per_gpu * n), hw, n)
        except ConfigError:
            best = {}
        weak_rows.append({"preset": preset, "gpus": n, **{s: _point(best.get(s)) for _, s in fams}})

    m = cfg.model
    return {
        "title": f"{m.preset} {m.arch} (d {m.dim}, {m.n_layers} layers, seq "
        f"{cfg.data.seq_len}, {t.dtype}) on {hw.name}",
        "lines": [{"arch": a, "strategy": s, "label": f"{a} + {s}"} for a, s in fams],
        "breakdown": breakdown,
        "scaling": {"gpus": counts, "global_batch": global_batch, "points": scaling},
        "weak": {"sequences_per_gpu": per_gpu, "rows": weak_rows},
    }


def _short(lay: dict[str, Any]) -> str:
    out = f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}"
    return out if lay["act_ckpt"] == "none" else f"{out} {lay['act_ckpt']}"


def draw(data: dict[str, Any], path: Path) -> None:
    """Write the three panels to ``path`` (any format matplotlib knows from the suffix)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 6), layout="constrained")
    ax_a, ax_b, ax_c = fig.subplots(1, 3)
    fig.suptitle(data["title"])
    lines = data["lines"]

    # (a) stacked bars
    names = [
        f"{line['label']}\n{_layout_text(r)}"
        for line, r in zip(lines, data["breakdown"], strict=True)
    ]
    x = range(len(names))
    bottom = [0.0] * len(names)
    for key, label, color in (
        ("compute_s", "compute", "#4c72b0"),
        ("comm_s", "exposed comm", "#dd8452"),
        ("bubble_s", "pipeline bubble", "#8c8c8c"),
    ):
        vals = [r.get(key, 0.0) for r in data["breakdown"]]
        ax_a.bar(x, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(data["breakdown"]):
        text = "no fitting layout" if "step_time_s" not in r else f"{r['step_time_s']:.3g} s"
        if r.get("fits") is False:
            text += "\n(does not fit)"
        ax_a.annotate(text, (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax_a.set_xticks(list(x), names, fontsize=8)
    ax_a.set_ylabel("seconds per optimizer step")
    ax_a.set_title("(a) step time by strategy")
    ax_a.legend(fontsize=8)
    ax_a.set_ylim(0, 1.15 * max(bottom) if max(bottom) > 0 else 1)

    # (b) strong scaling
    sc = data["scaling"]
    gpus = sc["gpus"]
    for line in lines:
        pts = sc["points"][line["strategy"]]
        ys = [p["tokens_per_s"] if p else math.nan for p in pts]
        spec = strategy_spec(line["strategy"])
        ax_b.plot(gpus, ys, spec.line, label=line["label"], color=spec.colour, alpha=0.85)
        if spec is REFERENCE:
            for n, p in zip(gpus, pts, strict=True):
                if p:
                    ax_b.annotate(
                        _short(p["layout"]),
                        (n, p["tokens_per_s"]),
                        fontsize=6,
                        rotation=30,
                        xytext=(3, -10),
                        textcoords="offset points",
                    )
    # Linear scaling from the fastest line at the smallest GPU count anything fits on.
    for i, n0 in enumerate(gpus):
        fitted = [p["tokens_per_s"] for pts in sc["points"].values() if (p := pts[i])]
        if fitted:
            y0 = max(fitted)
            ideal = [y0 * n / n0 for n in gpus[i:]]
            ax_b.plot(gpus[i:], ideal, ":", color="black", lw=1, label="linear")
            break
    ax_b.set_xscale("log", base=2)
    ax_b.set_yscale("log")
    ax_b.set_xlabel("GPUs")
    ax_b.set_ylabel("tokens / s")
    ax_b.set_title(
        f"(b) strong scaling, best layout per GPU count\n"
        f"global batch {sc['global_batch']} sequences"
    )
    ax_b.legend(fontsize=8)
    ax_b.grid(True, which="both", alpha=0.3)

    # (c) weak scaling
    wk = data["weak"]
    rows = wk["rows"]
    width = 0.8 / len(lines)
    for j, line in enumerate(lines):
        s = line["strategy"]
        xs = [i + (j - (len(lines) - 1) / 2) * width for i in range(len(rows))]
        ys = [r[s]["step_time_s"] if r[s] else 0.0 for r in rows]
        ax_c.bar(xs, ys, width, label=line["label"], color=strategy_spec(s).colour)
        for xi, r in zip(xs, rows, strict=True):
            text = _short(r[s]["layout"]) if r[s] else "no fit"
            y = r[s]["step_time_s"] if r[s] else 0.0
            ax_c.annotate(text, (xi, y), ha="center", va="bottom", fontsize=6, rotation=90)
    ax_c.set_xticks(
        range(len(rows)), [f"{r['preset']}\n{r['gpus']} GPU{'s' * (r['gpus'] > 1)}" for r in rows]
    )
    ax_c.set_ylabel("seconds per optimizer step")
    ax_c.set_title(
        f"(c) weak scaling, the BOOST paper's GPUs per preset\n"
        f"{wk['sequences_per_gpu']} sequences per GPU per step"
    )
    ax_c.legend(fontsize=8)
    ax_c.margins(y=0.25)
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise BoostlrError(f"--plot: cannot write {path}: {exc}") from None


def _layout_text(r: dict[str, Any]) -> str:
    return _short(r["layout"]) if "layout" in r else ""


# ----------------------------------------------------------------------------- JSON and table


def plan_json(rows: list[Prediction], hw: HardwareProfile, cfg: RunConfig) -> dict[str, Any]:
    out_rows = [r.row() for r in rows]
    ref = next((r for r in rows if r.strategy == REF), None)
    if ref is not None:
        for row, pred in zip(out_rows, rows, strict=True):
            row[f"{REF}_speedup"] = pred.step_time / ref.step_time
    return {
        "rows": out_rows,
        "hardware": as_dict(hw),
        "layout": rows[0].layout if rows else None,
        "model": {
            "preset": cfg.model.preset,
            "dim": cfg.model.dim,
            "n_layers": cfg.model.n_layers,
            "ffn_dim": cfg.model.ffn_dim,
            "rank": _rank_of(cfg),
        },
    }


def _rank_of(cfg: RunConfig) -> int | None:
    return cfg.model.rank if cfg.model.lowrank else round(cfg.model.rank_ratio * cfg.model.dim)


def search_json(cands: list[Candidate], hw: HardwareProfile, gpus: int) -> dict[str, Any]:
    return {
        "rows": [{**c.prediction.row(), "overrides": c.overrides} for c in cands],
        "hardware": as_dict(hw),
        "layout": {"gpus": gpus},
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


SPEEDUP_COLUMN = f"{REF} speed-up over row"


def _speedup_caption(rows: list[Prediction], ref: Prediction | None) -> str:
    """What the speed-up column divides by: the (first, i.e. fastest listed) reference row."""
    if ref is None:
        return f"{SPEEDUP_COLUMN}: -, no {REF} row listed to divide by (--top K lists more)"
    which = (
        f"the {REF} row"
        if sum(r.strategy == REF for r in rows) == 1
        else f"the first {REF} row (row {rows.index(ref) + 1}, the fastest {REF} layout listed)"
    )
    return (
        f"{SPEEDUP_COLUMN}: the row's step s / the step s of {which}, {ref.step_time:.3f} s "
        f"(above 1: {REF} is that much faster)"
    )


def print_rows(rows: list[Prediction], hw: HardwareProfile, title: str) -> None:
    if any(r.moe for r in rows):
        print_moe_rows(rows, hw, title)
        return
    from rich.console import Console
    from rich.table import Table

    ref = next((r for r in rows if r.strategy == REF), None)
    table = Table(title=title, caption=_speedup_caption(rows, ref))
    for col in (
        "arch",
        "strategy",
        "layout",
        "step s",
        "compute s",
        "exposed comm s",
        "bubble s",
        "TP GB/block fwd",
        "GEMM intensity min/mean",
        "memory GB/GPU",
        "fits",
        SPEEDUP_COLUMN,
    ):
        table.add_column(col, justify="left" if col in ("arch", "strategy", "layout") else "right")
    for r in rows:
        row = r.row()
        layout = _layout_cell(r.layout)
        table.add_row(
            r.arch,
            r.strategy or "none (tp 1)",
            layout,
            f"{r.step_time:.3f}",
            f"{r.compute:.3f}",
            f"{r.comm:.3f}",
            f"{r.bubble:.3f}",
            f"{r.tp_bytes_fwd_per_block / 2**30:.3f}",
            f"{row['gemm_intensity_min']:.0f}/{row['gemm_intensity_mean']:.0f}",
            f"{_gb(r.memory_total)}/{_gb(hw.memory)}",
            "yes" if r.fits else "NO",
            f"{r.step_time / ref.step_time:.2f}x" if ref else "-",
        )
    console = Console()
    Console(width=max(console.width, 160)).print(table)


def _layout_cell(lay: dict[str, Any]) -> str:
    layout = f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} {lay['act_ckpt']}"
    if lay["pp"] > 1:
        layout += f" {lay['pp_schedule']}x{lay['microbatches']}"
    if lay["dp"] > 1:
        layout += f" {lay['dp_mode']}"
        layout += " vocab/dp" if lay["vocab_dp"] else " vocab/fsdp"  # as auto resolved
    if lay.get("ep", 1) > 1:
        layout += f" ep{lay['ep']}"
    return layout


MOE_CAPTION = (
    "ep elems/copy: elements one routed copy moves over ep, out and back (latent 3r, hidden "
    "2d); ep bytes and expert memory assume balanced routing (exact over an ep group)"
)


def print_moe_rows(rows: list[Prediction], hw: HardwareProfile, title: str) -> None:
    """An MoE config's rows (docs/moe.md, "Planning"): one per dispatch form, with what a
    routed copy costs over ep beside the step."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=MOE_CAPTION)
    for col in (
        "arch",
        "dispatch",
        "layout",
        "step s",
        "compute s",
        "exposed comm s",
        "ep elems/copy",
        "ep GB/step",
        "GEMM intensity min/mean",
        "memory GB/GPU",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("arch", "dispatch", "layout") else "right")
    for r in rows:
        row, moe = r.row(), r.moe or {}
        table.add_row(
            r.arch,
            str(moe.get("dispatch")),
            _layout_cell(r.layout),
            f"{r.step_time:.3f}",
            f"{r.compute:.3f}",
            f"{r.comm:.3f}",
            f"{moe.get('elements_per_copy')}",
            f"{int(moe.get('ep_bytes_per_step', 0)) / 1e9:.3f}",
            f"{row['gemm_intensity_min']:.0f}/{row['gemm_intensity_mean']:.0f}",
            f"{_gb(r.memory_total)}/{_gb(hw.memory)}",
            "yes" if r.fits else "NO",
        )
    console = Console()
    Console(width=max(console.width, 160)).print(table)
    for r in rows:
        line = receive_bound_line(r, hw)
        if line:
            print(line)


def receive_bound_line(r: Prediction, hw: HardwareProfile) -> str | None:
    """At ep > 1: the most copies a rank's experts run on, and the worst rank's memory then
    (docs/moe.md, "A bound on what a rank receives"); ``None`` at ep 1."""
    moe = r.moe or {}
    bound = moe.get("receive") or {}
    if int(moe.get("ep", 1)) <= 1 or not bound:
        return None
    rows, balanced = int(bound["rows"]), int(bound["balanced_rows"])
    if bound["factor"] is None:
        why = "model.moe_capacity"
    elif bound["factor"]:
        why = f"parallel.ep_receive_factor {bound['factor']:g}"
    else:
        why = "no bound (parallel.ep_receive_factor 0): every copy to one rank"
    gb = bound["memory_gb_at_bound"]
    return (
        f"{r.arch} {moe.get('dispatch')}: a rank receives at most {rows:,} routed copies per "
        f"MoE layer and micro-batch ({rows / balanced:.2f}x the balanced {balanced:,}; {why}); "
        f"its memory then {gb:.1f}/{_gb(hw.memory)} GB: "
        f"{'fits' if bound['fits_at_bound'] else 'does NOT fit'}"
    )
