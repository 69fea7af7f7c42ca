"""``boostlr calibrate``: measure this device and write the 'local' hardware profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from boostlr.cli.common import Call, Command
from boostlr.errors import BoostlrError


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate",
        help="measure this device (CUDA if visible, else the CPU) and write the 'local' profile",
    )
    c.add_argument(
        "--out", default=None, help="profile file (default: <cache>/hardware/local.toml)"
    )
    c.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    c.add_argument(
        "--like",
        default="h100-sxm",
        help="profile whose link a single GPU keeps (two GPUs or a CPU measure their own)",
    )
    # Removed, kept hidden so that an old command line gets the reason, not argparse's error.
    c.add_argument("--procs", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.calibrate import calibrate

    if args.procs is not None:
        raise BoostlrError(
            "calibrate --procs was removed: the profile holds no CPU host terms any more, so "
            "nothing is measured by several processes at once"
        )
    out = Path(args.out) if args.out else None
    path, profile = calibrate(out, threads=args.threads, like=args.like)
    print(f"wrote {path}")
    print(profile.to_toml())


COMMAND = Command("calibrate", add_parser, run)
