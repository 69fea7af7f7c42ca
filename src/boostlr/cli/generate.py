"""``boostlr generate``: sample text from a checkpoint or an export directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from boostlr.cli.common import Call, Command


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample text from a checkpoint or an export directory")
    g.add_argument("path", help="checkpoint, run directory or export directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy decoding")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")


def run(args: argparse.Namespace, call: Call) -> None:
    from boostlr.export import load_pretrained
    from boostlr.generate import generate

    model, tokenizer = load_pretrained(Path(args.path), device=args.device)
    text = generate(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)


COMMAND = Command("generate", add_parser, run)
