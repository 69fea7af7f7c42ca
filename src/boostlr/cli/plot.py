"""``boostlr plot``: curves of several runs on one figure (needs matplotlib)."""

from __future__ import annotations

import argparse
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plot", help="curves of several runs on one figure (needs matplotlib)")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    pl.add_argument("--out", required=True, metavar="FILE.png", help="image to write")
    pl.add_argument("--x", choices=("step", "tokens", "flops"), default="step")
    pl.add_argument(
        "--y", default="loss", help="a metrics.jsonl key: loss, val_loss, tokens_per_s, ..."
    )
    pl.add_argument("--smooth", type=float, default=0.6, help="EMA weight for --y loss, [0, 1)")
    pl.add_argument("--title", default=None)


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.plots.runs import plot_runs

    out = plot_runs(
        [Path(r) for r in args.runs], Path(args.out), args.x, args.y, args.smooth, args.title
    )
    print(f"wrote {out}")


COMMAND = Command("plot", add_parser, run)
