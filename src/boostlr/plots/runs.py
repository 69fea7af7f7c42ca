"""``boostlr plot``: curves of several runs on one figure, read from their ``metrics.jsonl``.

Each run is labelled from its ``config.toml`` (arch, rank, TP strategy, layout). The x axis is
the optimizer step, the training tokens seen (``step × global batch × seq_len``) or the
training FLOPs (tokens × :func:`~boostlr.models.counting.flops_per_token`), so runs with
different batch sizes or archs compare at equal data or equal compute. For ``--y loss`` the
training loss is drawn raw (faint) and smoothed (an exponential moving average, debiased as
TensorBoard does), with the run's validation losses as points in the same colour.

Runs that log the same numbers (a rerun, a layout that is bit-for-bit the same) would draw one
curve over another. Each run therefore also has its own dash pattern and hollow marker,
the markers placed at staggered points, and the runs are drawn in order, the solid line of the
first at the bottom: every one of several identical curves stays visible.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boostlr.config import RunConfig, from_dict, load_toml
from boostlr.errors import BoostlrError
from boostlr.models.counting import flops_per_token
from boostlr.plots import require_matplotlib
from boostlr.rundir.layout import CONFIG_FILE, METRICS_FILE

X_AXES = ("step", "tokens", "flops")
X_LABELS = {"step": "optimizer step", "tokens": "training tokens", "flops": "training FLOPs"}
DASHES = ("-", "--", "-.", ":")  # the first run solid, at the bottom
MARKERS = ("o", "s", "^", "D", "v", "P")
MARKS_PER_CURVE = 8


@dataclass
class Run:
    path: Path
    cfg: RunConfig
    rows: list[dict[str, Any]]

    @property
    def tokens_per_step(self) -> int:
        t, p = self.cfg.train, self.cfg.parallel
        return t.batch_size * t.grad_accum * p.dp * self.cfg.data.seq_len

    def x_of(self, step: int, axis: str) -> float:
        if axis == "step":
            return float(step)
        tokens = step * self.tokens_per_step
        if axis == "tokens":
            return float(tokens)
        return float(tokens) * flops_per_token(self.cfg.model, self.cfg.data.seq_len)

    def series(self, key: str, axis: str) -> tuple[list[float], list[float]]:
        """``(x, y)`` of every row that has a finite number under ``key``."""
        xs, ys = [], []
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value) and isinstance(row.get("step"), int):
                    xs.append(self.x_of(row["step"], axis))
                    ys.append(float(value))
        return xs, ys

    def keys(self) -> set[str]:
        return {
            k
            for row in self.rows
            for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }


def load_run(path: Path) -> Run:
    path = Path(path)
    config, metrics = path / CONFIG_FILE, path / METRICS_FILE
    if not (config.is_file() and metrics.is_file()):
        raise BoostlrError(
            f"{path} is not a run directory (it needs {CONFIG_FILE} and {METRICS_FILE}): pass "
            "runs/<run> directories written by boostlr train"
        )
    rows = []
    for number, line in enumerate(metrics.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise BoostlrError(f"{metrics}:{number} is not JSON: the file is damaged") from None
    return Run(path, from_dict(load_toml(config)), rows)


def label(cfg: RunConfig) -> str:
    """``cola r=16, btp, pp1×dp2×tp2`` — what tells runs apart in a paper figure."""
    m, p = cfg.model, cfg.parallel
    parts = [m.arch + (f" r={m.rank}" if m.lowrank and m.rank else "")]
    strategy = p.strategy_for(m.arch)
    if strategy:
        parts.append(strategy)
    if p.world_size > 1:
        parts.append(f"pp{p.pp}×dp{p.dp}×tp{p.tp}")
    return ", ".join(parts)


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average (``weight`` 0 = no smoothing)."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(last / norm if norm else value)
    return out


def plot_runs(
    paths: list[Path],
    out: Path,
    x: str = "step",
    y: str = "loss",
    smooth: float = 0.6,
    title: str | None = None,
) -> Path:
    """Draw ``y`` against ``x`` for every run into ``out`` (format from its suffix)."""
    if x not in X_AXES:
        raise BoostlrError(f"--x {x!r} is not one of {', '.join(X_AXES)}")
    if not 0 <= smooth < 1:
        raise BoostlrError(f"--smooth must be in [0, 1), got {smooth}")
    runs = [load_run(p) for p in paths]
    available = set().union(*(r.keys() for r in runs)) - {"step"}
    if y not in available:
        raise BoostlrError(
            f"--y {y!r} is in no run's {METRICS_FILE}: choose one of {', '.join(sorted(available))}"
        )
    require_matplotlib("boostlr plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(runs, x, y, smooth, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=150)
    except ValueError as exc:  # an unknown file format
        raise BoostlrError(f"--out {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out


def _style(i: int, runs: int, points: int) -> dict[str, Any]:
    """Run ``i``'s colour, dash, hollow marker and marker positions (staggered by run)."""
    every = max(1, points // MARKS_PER_CURVE)
    return {
        "color": f"C{i % 10}",
        "linestyle": DASHES[i % len(DASHES)],
        "marker": MARKERS[i % len(MARKERS)],
        "markerfacecolor": "none",
        "markevery": (i * every // max(1, runs) % every, every),
        "zorder": 2 + i / max(1, runs),
    }


def draw(runs: list[Run], x: str, y: str, smooth: float, title: str | None) -> Any:
    """The figure of ``y`` against ``x`` for ``runs`` (matplotlib already imported)."""
    import matplotlib.pyplot as plt

    labels = [label(r.cfg) for r in runs]
    if len(set(labels)) < len(labels):  # same config twice: tell them apart by directory
        labels = [f"{lab} ({r.path.name})" for lab, r in zip(labels, runs, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_val = False
    for i, (run, name) in enumerate(zip(runs, labels, strict=True)):
        xs, ys = run.series(y, x)
        style = _style(i, len(runs), len(xs))
        if y == "loss":
            if xs:
                ax.plot(xs, ys, color=style["color"], alpha=0.25, linewidth=0.8)
                ax.plot(xs, ema(ys, smooth), markersize=4, linewidth=1.6, label=name, **style)
            vx, vy = run.series("val_loss", x)
            if vx:
                point = {k: style[k] for k in ("color", "marker", "markerfacecolor", "zorder")}
                ax.plot(vx, vy, linestyle="none", markersize=6, **point)
                any_val = True
        elif xs:
            ax.plot(xs, ys, markersize=4, linewidth=1.4, label=name, **style)
    if any_val:  # one legend entry for the points of every run
        ax.plot(
            [], [], "o", color="gray", markersize=5, markerfacecolor="none", label="validation loss"
        )
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(y)
    ax.set_title(title or f"{y} vs {X_LABELS[x]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
