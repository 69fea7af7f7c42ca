"""``boostlr`` command line: prepare | train | export | ckpt info | generate | eval |
import-hf | plot | plan | calibrate.

Input problems (:class:`~boostlr.errors.BoostlrError`) print one line and exit with code 2;
a diverged run exits with code 1 after keeping its last good checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from boostlr._torch_floor import require_torch
from boostlr.errors import EXIT_BAD_INPUT, EXIT_FAILED, BoostlrError, TrainingDiverged


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boostlr",
        description="Pre-train low-rank bottleneck LLMs (CoLA, SVD, LaX) with BOOST.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

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

    e = sub.add_parser("export", help="write a checkpoint as HF-named safetensors + config.json")
    e.add_argument("checkpoint", help="runs/<run>/checkpoints/step_N or a run directory")
    e.add_argument("--out", required=True, metavar="DIR")
    e.add_argument(
        "--merge-svd",
        action="store_true",
        help="arch svd only: multiply each B A into a dense weight and write a plain LLaMA "
        "(no remote code); cola and lax have a nonlinearity between the factors",
    )

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

    g = sub.add_parser("generate", help="sample text from a checkpoint or an export directory")
    g.add_argument("path", help="checkpoint, run directory or export directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy decoding")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")

    pl = sub.add_parser(
        "plan",
        help="predict step time, traffic and memory of full/vanilla/btp, or search layouts",
        description="Cost model (no GPU, nothing allocated). Config and --section.key VALUE "
        "overrides as for train.",
    )
    pl.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    pl.add_argument("--hardware", required=True, help="profile name or path to a .toml file")
    pl.add_argument("--gpus", type=int, default=None, help="world size (fills parallel.dp -1)")
    pl.add_argument("--search", action="store_true", help="rank every valid layout of --gpus")
    pl.add_argument("--top", type=int, default=5, help="layouts to print with --search")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.add_argument(
        "--trace",
        action="store_true",
        help="also run one rank of each role for two real steps on fake tensors and a fake "
        "process group of --gpus ranks: peak tensor bytes and every collective, beside the plan",
    )
    pl.add_argument(
        "--trace-rank",
        type=int,
        action="append",
        metavar="RANK",
        help="with --trace: trace only this global rank (repeat for more) instead of one of "
        "each role",
    )
    pl.add_argument(
        "--trace-jobs",
        type=int,
        metavar="N",
        help="with --trace: ranks traced at once (default: one per CPU core)",
    )
    pl.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also draw step-time breakdown, 1-256 GPU scaling and 1B-40B weak scaling "
        "(needs matplotlib: the 'plot' extra)",
    )

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
    c.add_argument("--procs", type=int, default=None, help=argparse.SUPPRESS)  # removed
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

    pl = sub.add_parser("plot", help="curves of several runs on one figure (needs matplotlib)")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    pl.add_argument("--out", required=True, metavar="FILE.png", help="image to write")
    pl.add_argument("--x", choices=("step", "tokens", "flops"), default="step")
    pl.add_argument(
        "--y", default="loss", help="a metrics.jsonl key: loss, val_loss, tokens_per_s, ..."
    )
    pl.add_argument("--smooth", type=float, default=0.6, help="EMA weight for --y loss, [0, 1)")
    pl.add_argument("--title", default=None)
    return parser


def _cmd_prepare(args: argparse.Namespace) -> None:
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


def _restart_with_allocator(cfg) -> None:
    """A one-process CPU run: start this command again, once, with jemalloc preloaded.

    Several ranks get it from the launcher (``LD_PRELOAD`` in their environment); one
    process can only have it from its own start. Nothing has been read or written yet.
    """
    from boostlr.parallel.device import resolve_device
    from boostlr.parallel.launch import under_launcher
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


_REEXEC_FLAG = "BOOSTLR_ALLOCATOR_PRELOADED"


def _cmd_train(args: argparse.Namespace, overrides: list[str], own_process: bool) -> None:
    from boostlr.config import build_config, parse_overrides
    from boostlr.rundir.layout import CONFIG_FILE
    from boostlr.train.run import train

    pairs = parse_overrides(overrides)
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
    if own_process:
        _restart_with_allocator(cfg)
    try:
        train(cfg, run_dir, resume=args.resume, console=not args.quiet)
    except ChildFailedError as exc:
        from boostlr.train.failures import killed_rank_messages

        for line in killed_rank_messages(exc, cfg):
            print(f"boostlr: {line}", file=sys.stderr, flush=True)
        raise


def _cmd_export(args: argparse.Namespace) -> None:
    from boostlr.export import export_checkpoint

    out = export_checkpoint(Path(args.checkpoint), Path(args.out), merge_svd=args.merge_svd)
    print(f"exported {args.checkpoint} -> {out}")


def _cmd_ckpt(args: argparse.Namespace) -> None:
    import json

    from boostlr.rundir.info import format_info, inspect_checkpoint

    info = inspect_checkpoint(Path(args.path), progress=True)
    print(json.dumps(info, indent=2) if args.json else format_info(info))


def _cmd_generate(args: argparse.Namespace) -> None:
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


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from boostlr.analysis import plan
    from boostlr.analysis.hardware import load_profile
    from boostlr.config import parse_overrides
    from boostlr.plots.plan import plan_json, print_rows, search_json

    if args.plot:
        from boostlr.plots import require_matplotlib

        require_matplotlib("--plot")
    hw = load_profile(args.hardware)
    cfg = plan.load_config(args.config, parse_overrides(overrides), args.gpus, args.search)
    if args.trace or args.trace_rank is not None or args.trace_jobs is not None:
        from boostlr.trace.run import check_trace_flags

        check_trace_flags(args.trace, args.search, args.gpus, args.trace_rank, args.trace_jobs)
    if args.search:
        cands = plan.search(cfg, hw, args.gpus, args.top)
        if args.json:
            print(json.dumps(search_json(cands, hw, args.gpus), indent=2))
        else:
            preds = [c.prediction for c in cands]
            print_rows(preds, hw, f"best layouts of {args.gpus} x {hw.name}")
    else:
        rows = plan.strategy_rows(cfg, hw)
        traced = None
        if args.trace:
            from boostlr.trace.compare import trace_json
            from boostlr.trace.run import trace

            traced = trace_json(cfg, hw, trace(cfg, args.trace_rank, args.trace_jobs))
        if args.json:
            out = plan_json(rows, hw, cfg)
            if traced is not None:
                out["trace"] = traced
            print(json.dumps(out, indent=2))
        else:
            print_rows(rows, hw, f"{cfg.model.preset} on {hw.name}")
            if traced is not None:
                from boostlr.trace.compare import format_trace

                print(format_trace(traced))
    if args.plot:
        from boostlr.plots.plan import draw, plot_data

        draw(plot_data(cfg, hw, args.gpus if args.search else None), Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)


def _cmd_calibrate(args: argparse.Namespace) -> None:
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


def _cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from boostlr.config import parse_overrides
    from boostlr.evaluate import run_eval

    result = run_eval(
        Path(args.path), args.split, args.max_tokens, parse_overrides(overrides), not args.json
    )
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(
            f"{args.path} [{args.split}]: loss {result.loss:.4f}  ppl {result.ppl:.2f}  "
            f"bits/byte {result.bits_per_byte:.4f}  ({result.tokens:,} tokens, "
            f"{result.bytes:,} bytes)"
        )


def _cmd_import_hf(args: argparse.Namespace, overrides: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from boostlr.config import parse_overrides
    from boostlr.import_hf import IMPORT_FILE, LINEARS, error_table, import_hf

    result = import_hf(Path(args.source), Path(args.out), parse_overrides(overrides))
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


def _cmd_plot(args: argparse.Namespace) -> None:
    from boostlr.plots.runs import plot_runs

    out = plot_runs(
        [Path(r) for r in args.runs], Path(args.out), args.x, args.y, args.smooth, args.title
    )
    print(f"wrote {out}")


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


# Subcommands that take --section.key VALUE pairs.
_TAKES_OVERRIDES = ("train", "eval", "import-hf", "plan")


def main(argv: list[str] | None = None) -> int:
    if (too_old := require_torch()) is not None:
        return too_old
    own_process = argv is None  # the command line itself, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    rest, extra = split_overrides(argv)
    args = parser.parse_args(rest)
    if extra and args.command not in _TAKES_OVERRIDES:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "prepare":
            _cmd_prepare(args)
        elif args.command == "train":
            _cmd_train(args, extra, own_process=own_process)
        elif args.command == "export":
            _cmd_export(args)
        elif args.command == "ckpt":
            _cmd_ckpt(args)
        elif args.command == "generate":
            _cmd_generate(args)
        elif args.command == "plan":
            _cmd_plan(args, extra)
        elif args.command == "calibrate":
            _cmd_calibrate(args)
        elif args.command == "eval":
            _cmd_eval(args, extra)
        elif args.command == "import-hf":
            _cmd_import_hf(args, extra)
        elif args.command == "plot":
            _cmd_plot(args)
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
    except KeyboardInterrupt:
        print("boostlr: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
