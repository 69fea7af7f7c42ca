"""``boostlr`` command line: prepare | train | export | ckpt info | generate | eval |
import-hf | plot | plan | calibrate.

This module assembles the parser and dispatches; each command is its own module here
(its sub-parser, its flag checks, its run), the shared pieces are in :mod:`.common`.

Input problems (:class:`~boostlr.errors.BoostlrError`) print one line and exit with code 2;
a diverged run exits with code 1 after keeping its last good checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from boostlr._torch_floor import require_torch
from boostlr.cli import (
    calibrate,
    ckpt,
    evaluate,
    export,
    generate,
    import_hf,
    plan,
    plot,
    prepare,
    train,
)
from boostlr.cli.common import Call, Command, run_reporting, split_overrides

__all__ = ["COMMANDS", "main", "split_overrides"]

# In the order ``boostlr --help`` lists them.
COMMANDS: dict[str, Command] = {
    module.COMMAND.name: module.COMMAND
    for module in (
        prepare,
        train,
        export,
        ckpt,
        generate,
        plan,
        calibrate,
        evaluate,
        import_hf,
        plot,
    )
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boostlr",
        description="Pre-train low-rank bottleneck LLMs (CoLA, SVD, LaX) with BOOST.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``boostlr`` console script (``argv`` None: the command line) and tests' entry."""
    if (too_old := require_torch()) is not None:
        return too_old
    own_process = argv is None  # the command line itself, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    rest, extra = split_overrides(argv)
    args = parser.parse_args(rest)
    command = COMMANDS[args.command]
    if extra and not command.takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_reporting(command, args, Call(extra, own_process))
