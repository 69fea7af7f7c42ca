"""What every ``boostlr`` command shares: the shape of a command, the ``--section.key VALUE``
split, and the one place an exception becomes a printed line and an exit code.

Input problems (:class:`~boostlr.errors.BoostlrError`) print one line and exit with code 2;
a diverged run exits with code 1 after keeping its last good checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from boostlr.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_STOPPED,
    BoostlrError,
    RunStopped,
    TrainingDiverged,
)

EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a SIGINT


@dataclass(frozen=True)
class Call:
    """What ``main`` hands a command besides its parsed flags."""

    overrides: list[str]  # the --section.key VALUE words, not yet parsed (empty unless taken)
    own_process: bool  # the command line itself, not ``main(argv)`` called from Python


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, the sub-parser it adds, and what runs it.

    ``takes_overrides``: whether ``--section.key VALUE`` pairs mean anything to it; the
    others refuse them as argparse refuses any unknown flag.
    """

    name: str
    add_parser: Callable[[argparse._SubParsersAction], None]
    run: Callable[[argparse.Namespace, Call], None]
    takes_overrides: bool = False


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull ``--section.key VALUE`` pairs out before argparse sees (and misreads) them."""
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and "." in name:
            takes_value = "=" not in arg and i + 1 < len(argv)
            overrides.extend(argv[i : i + (2 if takes_value else 1)])
            i += 2 if takes_value else 1
        else:
            rest.append(arg)
            i += 1
    return rest, overrides


def run_reporting(command: Command, args: argparse.Namespace, call: Call) -> int:
    """Run ``command``; an error it raises becomes one ``boostlr: ...`` line and a code."""
    try:
        command.run(args, call)
    except BoostlrError as exc:
        print(f"boostlr: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingDiverged as exc:
        print(f"boostlr: training diverged: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ChildFailedError as exc:  # each rank has printed its own error already
        failures = exc.failures.values()
        ranks = ", ".join(str(rank) for rank in sorted(exc.failures))
        print(f"boostlr: training failed on rank(s) {ranks} (see above)", file=sys.stderr)
        bad_input = all(f.exitcode == EXIT_BAD_INPUT for f in failures)
        return EXIT_BAD_INPUT if bad_input else EXIT_FAILED
    except RunStopped as exc:  # saved at the step it stopped at: resume it
        if str(exc):
            print(f"boostlr: {exc}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("boostlr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
