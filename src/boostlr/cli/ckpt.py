"""``boostlr ckpt info``: a checkpoint's step, layout, model and files, sha256-verified."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("ckpt", help="inspect checkpoints")
    ckpt_sub = c.add_subparsers(dest="ckpt_command", required=True)
    ci = ckpt_sub.add_parser(
        "info",
        help="print a checkpoint's step, layout, model and files, and verify their sha256",
        description="Print step, format, layout, model shape, parameter count and file sizes, "
        "and verify every file's sha256 against meta.json. Exit 2 on a missing, truncated, "
        "corrupt or foreign checkpoint.",
    )
    ci.add_argument("path", help="runs/<run>/checkpoints/step_N, or a run directory (newest)")
    ci.add_argument("--json", action="store_true", help="print one JSON object instead")


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.rundir.info import format_info, inspect_checkpoint

    info = inspect_checkpoint(Path(args.path), progress=True)
    print(json.dumps(info, indent=2) if args.json else format_info(info))


COMMAND = Command("ckpt", add_parser, run)
