"""Do low-rank models learn as well? Validation loss against tokens and FLOPs, per arch and layout.

Part ``archs``: ``full``, ``cola``, ``svd`` and ``lax`` at the same shape, trained by
``boostlr train`` (one run directory each) on the same data in the same order for the same
tokens. Prints each arch's parameters, tokens/s and validation losses, plots validation loss
against training tokens and against training FLOPs, and answers the CoLA question: does CoLA
reach the dense model's final validation loss at fewer FLOPs, and at what ratio?

Part ``layouts`` (BOOST's check that BTP changes speed, not learning): a 2-layer, hidden-256
CoLA trained 800 steps on one device, at BTP TP 4, at DP 4 and at PP 2 × TP 2 — the same
global batch, so the same windows every step — with the curves overlaid and the largest
relative difference of the validation losses from the single-device run printed.

    python benchmarks/convergence.py                 # both parts: roughly 1-1.5 h on 2 cores
    python benchmarks/convergence.py --part archs --record   # + append the result to RESULTS.md
    python benchmarks/convergence.py --tiny          # smoke test: seconds, tiny shapes

Runs go to ``--out`` (default ``runs/convergence``); an existing run directory of the same
name is resumed if complete, so a re-run only re-plots. ``--record`` appends a section to
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from boostlr.config import RunConfig, build_config
from boostlr.data import prepare_dataset
from boostlr.models.counting import count_params, flops_per_token
from boostlr.plots.runs import load_run, plot_runs
from boostlr.rundir.checkpoint import newest_checkpoint
from boostlr.train import run as trainer

ARCHS = ("full", "cola", "svd", "lax")
RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclass
class Budget:
    """The shape and schedule of a part (the full-size default or the ``--tiny`` smoke)."""

    model: dict[str, object]
    steps: int
    batch_size: int
    seq_len: int
    eval_every: int
    val_batches: int
    log_every: int


# The archs part: d=256, 4 layers, 4096-token BPE, 3000 steps of 8 x 128 tokens (3.1M tokens,
# about 1.3 epochs of the stdlib corpus's 2.4M training tokens, so overfitting stays small).
# About 5-7k tokens/s per arch on the 2-core VM: four runs take roughly 35-40 minutes.
SHAPE_256 = {"dim": 256, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 704}
ARCH_BUDGET = Budget({**SHAPE_256, "n_layers": 4}, 3000, 8, 128, 100, 8, 20)
# The layouts part: BOOST's 2-layer, hidden-256 CoLA, 800 steps of a 16 x 128 global batch.
LAYOUT_BUDGET = Budget({**SHAPE_256, "n_layers": 2}, 800, 16, 128, 50, 8, 20)
TINY_ARCH = Budget({"preset": "tiny"}, 6, 4, 32, 3, 2, 1)
TINY_LAYOUT = Budget({"preset": "tiny"}, 4, 4, 32, 2, 2, 1)
# name -> (pp, dp, tp); the global batch is the same for all: batch_size / dp per dp rank.
LAYOUTS = {"single": (1, 1, 1), "btp-tp4": (1, 1, 4), "dp4": (1, 4, 1), "pp2xtp2": (2, 1, 2)}
TINY_LAYOUTS = {"single": (1, 1, 1), "btp-tp2": (1, 1, 2), "dp2": (1, 2, 1)}


def run_config(
    budget: Budget, arch: str, args: argparse.Namespace, layout: tuple[int, int, int]
) -> RunConfig:
    pp, dp, tp = layout
    values: dict[str, object] = {f"model.{k}": v for k, v in budget.model.items()}
    values.update(
        {
            "model.arch": arch,
            "train.steps": budget.steps,
            "train.batch_size": budget.batch_size // dp,
            "train.eval_every": budget.eval_every,
            "train.log_every": budget.log_every,
            "train.ckpt_every": budget.steps,
            "train.keep_checkpoints": 1,
            "train.dtype": args.dtype,
            "train.seed": args.seed,
            "data.seq_len": budget.seq_len,
            # The trainer validates on val_batches x the global batch windows at every layout.
            "data.val_batches": budget.val_batches,
            "parallel.pp": pp,
            "parallel.dp": dp,
            "parallel.tp": tp,
            "parallel.device": args.device,
        }
    )
    if args.data:
        values["data.path"] = str(args.data)
    return build_config(overrides=[(k, str(v)) for k, v in values.items()])


def train_once(cfg: RunConfig, run_dir: Path) -> float:
    """Train (or reuse a finished run); returns the wall seconds spent now."""
    done = newest_checkpoint(run_dir / "checkpoints")
    if done is not None and done.step >= cfg.train.steps:
        return 0.0
    started = time.perf_counter()
    trainer.train(cfg, run_dir, resume=done is not None, console=False)
    return time.perf_counter() - started


@dataclass
class Summary:
    name: str
    params: int
    non_embedding: int
    tokens_per_s: float
    flops_per_token: int
    val_steps: list[int]
    val_losses: list[float]
    tokens: list[float]
    flops: list[float]
    seconds: float


def summarize(name: str, run_dir: Path, seconds: float) -> Summary:
    run = load_run(run_dir)
    cfg = run.cfg
    speeds = [r["tokens_per_s"] for r in run.rows if "tokens_per_s" in r and r["step"] > 1]
    steps = [r["step"] for r in run.rows if isinstance(r.get("val_loss"), float)]
    counts = count_params(cfg.model)
    tokens, _ = run.series("val_loss", "tokens")
    flops, losses = run.series("val_loss", "flops")
    return Summary(
        name,
        counts.total,
        counts.non_embedding,
        statistics.median(speeds) if speeds else float("nan"),
        flops_per_token(cfg.model, cfg.data.seq_len),
        steps,
        losses,
        tokens,
        flops,
        seconds,
    )


def flops_to_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    """First x at which the curve reaches ``target`` (linear between evaluations), or None."""
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y <= target:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (x - x0) * (y0 - target) / (y0 - y) if y0 != y else x
    return None


def cola_verdict(summaries: dict[str, Summary]) -> list[str]:
    """Each low-rank arch against the dense model's final validation loss, in FLOPs."""
    dense = summaries["full"]
    target = dense.val_losses[-1]
    dense_flops = flops_to_reach(dense.flops, dense.val_losses, target)
    lines = [
        f"dense (full) final validation loss {target:.4f}, first reached at "
        f"{dense_flops:.3e} training FLOPs"
    ]
    for name in ("cola", "svd", "lax"):
        if name not in summaries:
            continue
        s = summaries[name]
        reached = flops_to_reach(s.flops, s.val_losses, target)
        if reached is None:
            lines.append(
                f"{name}: does NOT reach it in {s.flops[-1]:.3e} FLOPs "
                f"({s.flops[-1] / dense_flops:.2f}x dense's); final {s.val_losses[-1]:.4f} "
                f"(+{s.val_losses[-1] - target:.4f})"
            )
        else:
            fewer = "fewer" if reached < dense_flops else "MORE"
            lines.append(
                f"{name}: reaches it at {reached:.3e} FLOPs = {reached / dense_flops:.2f}x "
                f"dense's ({fewer} FLOPs); final {s.val_losses[-1]:.4f}"
            )
    return lines


def arch_table(summaries: dict[str, Summary]) -> list[str]:
    ref = summaries.get("full")
    header = (
        f"{'arch':<6} {'params':>11} {'non-emb':>10} {'FLOP/token':>11} {'tokens/s':>9} "
        f"{'vs full':>8} {'final val':>10} {'train s':>8}"
    )
    out = [header, "-" * len(header)]
    for s in summaries.values():
        ratio = s.tokens_per_s / ref.tokens_per_s if ref else float("nan")
        out.append(
            f"{s.name:<6} {s.params:>11,} {s.non_embedding:>10,} {s.flops_per_token:>11.3e} "
            f"{s.tokens_per_s:>9,.0f} {ratio:>7.2f}x {s.val_losses[-1]:>10.4f} "
            f"{s.seconds:>8.0f}"
        )
    out.append("")
    out.append("validation loss by step: " + ", ".join(summaries))
    steps = next(iter(summaries.values())).val_steps
    for i, step in enumerate(steps):
        values = "  ".join(f"{s.val_losses[i]:.4f}" for s in summaries.values())
        out.append(f"  step {step:>6}  {values}")
    return out


def layout_table(summaries: dict[str, Summary]) -> tuple[list[str], float]:
    base = summaries["single"]
    worst = 0.0
    header = f"{'layout':<9} {'tokens/s':>9} {'final val':>10} {'max rel diff vs single':>23}"
    out = [header, "-" * len(header)]
    for s in summaries.values():
        diffs = [abs(a - b) / abs(b) for a, b in zip(s.val_losses, base.val_losses, strict=True)]
        worst = max(worst, max(diffs))
        out.append(
            f"{s.name:<9} {s.tokens_per_s:>9,.0f} {s.val_losses[-1]:>10.4f} {max(diffs):>23.2e}"
        )
    out.append(f"max relative difference of the validation losses: {worst:.2e}")
    return out, worst


def part_archs(args: argparse.Namespace, out: Path) -> list[str]:
    budget = TINY_ARCH if args.tiny else ARCH_BUDGET
    summaries, dirs = {}, []
    for arch in args.archs:
        run_dir = out / f"arch-{arch}"
        seconds = train_once(run_config(budget, arch, args, (1, 1, 1)), run_dir)
        summaries[arch] = summarize(arch, run_dir, seconds)
        dirs.append(run_dir)
        print(f"  {arch}: {summaries[arch].val_losses[-1]:.4f} ({seconds:.0f} s)", flush=True)
    for x in ("tokens", "flops"):
        plot_runs(dirs, out / f"val_vs_{x}.png", x=x, y="val_loss")
    plot_runs(dirs, out / "loss_vs_flops.png", x="flops", y="loss")
    lines = [
        f"# archs: model {budget.model}, {budget.steps} steps x {budget.batch_size} x "
        f"{budget.seq_len} tokens, {args.dtype}, device {args.device}",
        *arch_table(summaries),
        "",
    ]
    if "full" in summaries and len(summaries) > 1:
        lines += cola_verdict(summaries)
    lines.append(f"plots: {out}/val_vs_tokens.png, {out}/val_vs_flops.png")
    return lines


def part_layouts(args: argparse.Namespace, out: Path) -> list[str]:
    budget = TINY_LAYOUT if args.tiny else LAYOUT_BUDGET
    layouts = TINY_LAYOUTS if args.tiny else LAYOUTS
    summaries, dirs = {}, []
    for name, layout in layouts.items():
        run_dir = out / f"layout-{name}"
        seconds = train_once(run_config(budget, "cola", args, layout), run_dir)
        summaries[name] = summarize(name, run_dir, seconds)
        dirs.append(run_dir)
        print(f"  {name}: {summaries[name].val_losses[-1]:.4f} ({seconds:.0f} s)", flush=True)
    plot_runs(dirs, out / "layouts.png", x="step", y="loss")
    table, _ = layout_table(summaries)
    return [
        f"# layouts: cola, model {budget.model}, {budget.steps} steps, global batch "
        f"{budget.batch_size} x {budget.seq_len}, {args.dtype}",
        *table,
        f"plot: {out}/layouts.png",
    ]


def small_dataset(out: Path) -> Path:
    """The smoke test's data: a few stdlib files, not the whole default corpus."""
    path = out / "data"
    if not (path / "manifest.json").is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = [stdlib / n for n in ("argparse.py", "textwrap.py", "dataclasses.py")]
        prepare_dataset(files, path, tokenizer="bpe:512", val_fraction=0.2, progress=False)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("archs", "layouts", "all"), default="all")
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--out", type=Path, default=Path("runs/convergence"))
    parser.add_argument("--data", type=Path, default=None, help="default: the stdlib corpus")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke test")
    parser.add_argument("--record", action="store_true", help="append the result to RESULTS.md")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny and args.data is None:
        args.data = small_dataset(args.out)
    lines: list[str] = []
    if args.part in ("archs", "all"):
        lines += part_archs(args, args.out)
    if args.part in ("layouts", "all"):
        lines += ["", *part_layouts(args, args.out)]
    print("\n".join(lines))
    if args.record:
        stamp = datetime.date.today().isoformat()
        machine = (
            f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        given = sys.argv[1:] if argv is None else argv
        command = "python benchmarks/convergence.py " + " ".join(given)
        with RESULTS.open("a", encoding="utf-8") as fh:
            fh.write(
                f"\n## convergence.py — {stamp}\n\nMachine: {machine}.\n\n```\n$ {command}\n"
                + "\n".join(lines)
                + "\n```\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
