"""``boostlr eval``: loss, perplexity and bits per byte of a checkpoint on a whole split.

(Named after :mod:`boostlr.evaluate`, which does the work: ``eval`` is a builtin.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser(
        "eval",
        help="loss, perplexity and bits per byte of a checkpoint on a whole split",
        description="Evaluate a checkpoint, run or export directory on its own dataset (or "
        "--data.path). Also takes --data.seq_len, --train.batch_size, --train.dtype, "
        "--parallel.device.",
    )
    v.add_argument("path", help="checkpoint, run directory or export directory")
    v.add_argument("--split", choices=("val", "train"), default="val")
    v.add_argument("--max-tokens", type=int, default=None, help="stop after N target tokens")
    v.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.config import parse_overrides
    from boostlr.evaluate import run_eval

    result = run_eval(
        Path(args.path), args.split, args.max_tokens, parse_overrides(call.overrides), not args.json
    )
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(
            f"{args.path} [{args.split}]: loss {result.loss:.4f}  ppl {result.ppl:.2f}  "
            f"bits/byte {result.bits_per_byte:.4f}  ({result.tokens:,} tokens, "
            f"{result.bytes:,} bytes)"
        )


COMMAND = Command("eval", add_parser, run, takes_overrides=True)
