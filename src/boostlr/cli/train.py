"""``boostlr train``: build the config from a file and ``--section.key VALUE`` overrides,
check the ``--resume`` flags, and hand over to the trainer."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from boostlr.cli.common import Call, Command
from boostlr.errors import BoostlrError, RunStopped

# Set in the environment of the one re-execution, so that it happens once.
_REEXEC_FLAG = "BOOSTLR_ALLOCATOR_PRELOADED"


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        help="train a model",
        description="Train. Any config value can be overridden as --section.key VALUE "
        "(sections: model, data, train, parallel); every key is in docs/config.md.",
    )
    t.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    t.add_argument("--run-dir", default=None, help="run directory (default runs/<timestamp>)")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint of --run-dir",
    )
    t.add_argument("--quiet", action="store_true", help="no console progress")


def _restart_with_allocator(cfg) -> None:
    """A one-process CPU run: start this command again, once, with jemalloc preloaded.

    Several ranks get it from the launcher (``LD_PRELOAD`` in their environment); one
    process can only have it from its own start. Nothing has been read or written yet.
    """
    from boostlr.parallel.launch import under_launcher
    from boostlr.platform import resolve_device
    from boostlr.train.host_alloc import allocator_env, preloaded_allocator

    if os.environ.get(_REEXEC_FLAG) or under_launcher() or preloaded_allocator():
        return
    if cfg.parallel.world_size != 1 or cfg.parallel.max_restarts:
        return
    device = resolve_device(cfg.parallel.device).type
    env = allocator_env(cfg.train.cpu_alloc_cache, device)
    if env:
        sys.stdout.flush()
        sys.stderr.flush()
        argv = [sys.executable, "-m", "boostlr.cli", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, **env, _REEXEC_FLAG: "1"})


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.config import build_config, parse_overrides
    from boostlr.rundir.layout import CONFIG_FILE
    from boostlr.train.run import train

    pairs = parse_overrides(call.overrides)
    if args.resume:
        if args.run_dir is None:
            raise BoostlrError("--resume needs --run-dir pointing at the run to continue")
        run_dir = Path(args.run_dir)
        saved = run_dir / CONFIG_FILE
        if not saved.is_file():
            raise BoostlrError(f"--resume: {saved} not found: is {run_dir} a boostlr run?")
        cfg = build_config(saved, pairs, saved=True)
        if args.config is not None:
            raise BoostlrError(
                "--resume takes the run's own config.toml: drop the config file argument"
            )
    else:
        cfg = build_config(args.config, pairs)
        run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if call.own_process:
        _restart_with_allocator(cfg)
    try:
        result = train(cfg, run_dir, resume=args.resume, console=not args.quiet)
    except ChildFailedError as exc:
        from boostlr.train.failures import killed_rank_messages

        for line in killed_rank_messages(exc, cfg):
            print(f"boostlr: {line}", file=sys.stderr, flush=True)
        raise
    if result.stopped is not None:
        from boostlr.train.stopping import ignore_signals

        ignore_signals(cfg.train.save_on_signal)  # saved: exit 75, whatever comes now
        raise RunStopped(_stopped_line(result.stopped, run_dir))


def _stopped_line(why: str, run_dir: Path) -> str:
    """The one line of an early stop (rank 0's; the other ranks of a launcher say nothing)."""
    from boostlr.errors import EXIT_STOPPED

    if os.environ.get("RANK", "0") != "0":
        return ""
    return (
        f"{why}; resume with `boostlr train --run-dir {run_dir} --resume` "
        f"(exit code {EXIT_STOPPED})"
    )


COMMAND = Command("train", add_parser, run, takes_overrides=True)
