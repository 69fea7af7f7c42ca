"""``boostlr import-hf``: a Hugging Face LLaMA directory as a run (full, or low-rank by SVD)."""

from __future__ import annotations

import argparse
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser(
        "import-hf",
        help="turn a Hugging Face LLaMA directory into a run (full, or low-rank by SVD)",
        description="Import config.json + *.safetensors + tokenizer.json as a boostlr run "
        "directory with one checkpoint (step 0). Takes --model.arch full|svd|cola, "
        "--model.rank R (or --model.rank_ratio), --model.mlp, and --data.* / --train.* / "
        "--parallel.* for the training that continues it. A boostlr low-rank export comes "
        "back with its own model and factors (no --model.*).",
    )
    h.add_argument("source", help="Hugging Face model directory")
    h.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory to write")


def run(args: argparse.Namespace, call: Call) -> None:
    from rich.console import Console
    from rich.table import Table

    from boostlr.config import parse_overrides
    from boostlr.import_hf import IMPORT_FILE, LINEARS, error_table, import_hf

    result = import_hf(Path(args.source), Path(args.out), parse_overrides(call.overrides))
    m = result.cfg.model
    if result.errors:
        table = Table(title=f"relative reconstruction error ||W - BA||_F / ||W||_F, rank {m.rank}")
        for column in ("layer", *LINEARS):
            table.add_column(column, justify="right")
        for row in error_table(result.errors, m.n_layers):
            table.add_row(*row)
        Console().print(table)
        worst = max(result.errors, key=result.errors.get)
        print(f"max error {result.errors[worst]:.4f} ({worst}); all in {args.out}/{IMPORT_FILE}")
    print(f"imported {args.source} as arch {m.arch} -> {result.run_dir} (checkpoints/step_0)")
    if result.cfg.data.path is None:
        print(
            "to train it, import again with --data.path DIR (data prepared with boostlr prepare "
            f"--tokenizer {Path(args.source) / 'tokenizer.json'}): --resume keeps data.path"
        )


COMMAND = Command("import-hf", add_parser, run, takes_overrides=True)
