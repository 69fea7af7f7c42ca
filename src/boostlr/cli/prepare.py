"""``boostlr prepare``: tokenize text files into memory-mapped token shards."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from boostlr.cli.common import Call, Command
from boostlr.errors import BoostlrError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text files into memory-mapped token shards")
    p.add_argument(
        "--input",
        nargs="+",
        default=None,
        metavar="PATH",
        help="files or directories (.txt .md .py .jsonl .parquet); "
        "default: the Python standard library",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to write")
    p.add_argument(
        "--tokenizer",
        default="bpe:4096",
        help="bpe:VOCAB to train a byte-level BPE, or a tokenizer.json / HF dir",
    )
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    p.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="write each phase's wall time, CPU time and cores used to FILE as JSON",
    )


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.data import prepare_dataset
    from boostlr.data.progress import summary

    if not 0 <= args.val_fraction < 1:
        raise BoostlrError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    phases: list = []
    manifest = prepare_dataset(
        args.input,
        Path(args.out),
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        seed=args.seed,
        overwrite=args.overwrite,
        phases=phases,
    )
    splits = manifest["splits"]
    print(
        f"wrote {args.out}: vocab {manifest['vocab_size']}, "
        + ", ".join(f"{name} {info['tokens']:,} tokens" for name, info in splits.items())
    )
    print(f"time: {summary(phases)}")
    if args.stats:
        stats = [meter.stats() for meter in phases]
        Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


COMMAND = Command("prepare", add_parser, run)
