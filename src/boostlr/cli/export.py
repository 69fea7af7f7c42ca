"""``boostlr export``: a checkpoint as HF-named safetensors + config.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a checkpoint as HF-named safetensors + config.json")
    e.add_argument("checkpoint", help="runs/<run>/checkpoints/step_N or a run directory")
    e.add_argument("--out", required=True, metavar="DIR")
    e.add_argument(
        "--merge-svd",
        action="store_true",
        help="arch svd only: multiply each B A into a dense weight and write a plain LLaMA "
        "(no remote code); cola and lax have a nonlinearity between the factors",
    )


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.export import export_checkpoint

    out = export_checkpoint(Path(args.checkpoint), Path(args.out), merge_svd=args.merge_svd)
    print(f"exported {args.checkpoint} -> {out}")


COMMAND = Command("export", add_parser, run)
