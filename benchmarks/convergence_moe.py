"""Does a CoLA MoE (latent dispatch) learn as well per FLOP as a dense MoE and a dense model?

Three models at one shape, trained by ``boostlr train`` (one run directory each, one
device) on the default corpus (the stdlib corpus, BPE 4096) in the same order, each for the
same training FLOPs — so each gets its own number of steps, and its own full learning-rate
schedule over them:

- ``dense``: arch ``full``, the dense MLP of width ``k x f_e``;
- ``dense MoE``: arch ``full``, E experts of width f_e (whole SwiGLU MLPs, hidden dispatch),
  top-k routed: the same active MLP width as ``dense``;
- ``CoLA MoE latent``: arch ``cola`` at rank r, the same E, k, f_e, latent dispatch.

FLOPs per token are :func:`boostlr.models.counting.flops_per_token` (what the trainer's
FLOP/s and ``boostlr plot --x flops`` use): an MoE block counts its router, the shared outer
factors (latent) and the k routed experts a token uses, not all E. Prints each model's
parameters, FLOPs per token, steps, tokens/s and validation losses, its final validation
loss at the common budget, and the FLOPs at which CoLA MoE latent first reaches dense MoE's
final validation loss (the issue's goal: at most 0.7x dense MoE's).

    python benchmarks/convergence_moe.py            # about 5-6 minutes on 2 idle cores
    python benchmarks/convergence_moe.py --quick    # tiny shapes and data: a check, seconds

Runs go to ``--out`` (default ``runs/convergence_moe``); a finished run directory of the
same name is reused, so a re-run only re-prints and re-plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import (  # noqa: E402  (the benchmarks directory is not a package)
    Budget,
    Summary,
    flops_to_reach,
    run_config,
    small_dataset,
    summarize,
    train_once,
)

from boostlr.config import build_config  # noqa: E402
from boostlr.models.counting import flops_per_token  # noqa: E402
from boostlr.plots.runs import plot_runs  # noqa: E402

# d 256 (convergence.py's shape), 4 blocks; E 8 experts of f_e 352, top 2: the active MLP
# width is the dense model's 704. CoLA at r = d/4. The budget is the dense model's FLOPs
# for 240 steps of 8 x 128 tokens; evaluations every tenth of each run.
SHAPE = {"dim": 256, "n_heads": 4, "n_kv_heads": 4, "n_layers": 4}
MOE = {"moe_experts": 8, "moe_top_k": 2, "moe_ffn_dim": 352}
FULL = {"shape": SHAPE, "moe": MOE, "rank": 64, "dense_steps": 240, "batch": 8, "seq": 128}
QUICK_MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 32}
QUICK = {"shape": {"preset": "tiny"}, "moe": QUICK_MOE, "rank": 16, "dense_steps": 6}
QUICK |= {"batch": 4, "seq": 32}
EVALS = 10  # evaluations per run
VAL_BATCHES = {False: 8, True: 2}


def models(size: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Name -> (arch, ``model.*`` keys) of the three models at ``size``."""
    moe = size["moe"]
    dense_ffn = moe["moe_top_k"] * moe["moe_ffn_dim"]
    return {
        "dense": ("full", {**size["shape"], "ffn_dim": dense_ffn}),
        "dense MoE": ("full", {**size["shape"], **moe, "moe_dispatch": "hidden"}),
        "CoLA MoE latent": (
            "cola",
            {**size["shape"], **moe, "moe_dispatch": "latent", "rank": size["rank"]},
        ),
    }


def model_flops(arch: str, keys: dict[str, Any], seq: int, vocab: int) -> int:
    """Training FLOPs per token of one model (the trainer's count)."""
    overrides = [("model.arch", arch), ("model.vocab_size", str(vocab))]
    overrides += [(f"model.{k}", str(v)) for k, v in keys.items()]
    cfg = build_config(overrides=overrides + [("data.seq_len", str(seq))])
    return flops_per_token(cfg.model, seq)


def budgets(size: dict[str, Any], vocab: int, val_batches: int) -> dict[str, Budget]:
    """Each model's schedule for the same training FLOPs: the dense model's ``dense_steps``."""
    tokens = size["batch"] * size["seq"]
    specs = models(size)
    per_token = {n: model_flops(a, k, size["seq"], vocab) for n, (a, k) in specs.items()}
    total = per_token["dense"] * tokens * size["dense_steps"]
    out = {}
    for name, (_, keys) in specs.items():
        steps = max(1, round(total / (per_token[name] * tokens)))
        every = max(1, steps // EVALS)
        out[name] = Budget(keys, steps, size["batch"], size["seq"], every, val_batches, every)
    return out


def moe_table(summaries: dict[str, Summary], steps: dict[str, int]) -> list[str]:
    header = (
        f"{'model':<16} {'params':>10} {'FLOP/token':>11} {'steps':>6} {'train FLOPs':>12} "
        f"{'tokens/s':>9} {'final val':>10} {'train s':>8}"
    )
    out = [header, "-" * len(header)]
    for name, s in summaries.items():
        out.append(
            f"{name:<16} {s.params:>10,} {s.flops_per_token:>11.3e} {steps[name]:>6} "
            f"{s.flops[-1]:>12.3e} {s.tokens_per_s:>9,.0f} {s.val_losses[-1]:>10.4f} "
            f"{s.seconds:>8.0f}"
        )
    out += ["", "validation loss by training FLOPs (each model's evaluations):"]
    for name, s in summaries.items():
        points = ", ".join(f"{x:.2e}: {y:.3f}" for x, y in zip(s.flops, s.val_losses, strict=True))
        out.append(f"  {name}: {points}")
    return out


def verdict(summaries: dict[str, Summary]) -> list[str]:
    """CoLA MoE latent and the dense model against dense MoE's final validation loss."""
    ref = summaries["dense MoE"]
    target = ref.val_losses[-1]
    ref_flops = flops_to_reach(ref.flops, ref.val_losses, target)
    lines = [
        f"dense MoE final validation loss {target:.4f}, first reached at {ref_flops:.3e} "
        "training FLOPs"
    ]
    for name in ("CoLA MoE latent", "dense"):
        s = summaries[name]
        reached = flops_to_reach(s.flops, s.val_losses, target)
        goal = " (goal <= 0.7x)" if name == "CoLA MoE latent" else ""
        if reached is None:
            lines.append(
                f"{name}: does NOT reach it in {s.flops[-1]:.3e} FLOPs{goal}; final "
                f"{s.val_losses[-1]:.4f} (+{s.val_losses[-1] - target:.4f})"
            )
        else:
            ratio = reached / ref_flops
            met = ("met" if ratio <= 0.7 else "NOT met") if goal else ""
            lines.append(
                f"{name}: reaches it at {reached:.3e} FLOPs = {ratio:.2f}x dense MoE's{goal}"
                f"{' ' + met if met else ''}; final {s.val_losses[-1]:.4f}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/convergence_moe"))
    parser.add_argument("--data", type=Path, default=None, help="default: the stdlib corpus")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and data: seconds")
    parser.add_argument(
        "--dense-steps", type=int, default=None, help="the FLOP budget in the dense model's steps"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick and args.data is None:
        args.data = small_dataset(args.out)
    size = QUICK if args.quick else FULL
    if args.dense_steps is not None:
        size = {**size, "dense_steps": args.dense_steps}
    vocab = 512 if args.quick else 4096  # the corpora's BPE vocabularies
    plan = budgets(size, vocab, VAL_BATCHES[args.quick])
    arches = {name: arch for name, (arch, _) in models(size).items()}
    summaries, dirs = {}, []
    for name, budget in plan.items():
        run_dir = args.out / name.replace(" ", "-")
        seconds = train_once(run_config(budget, arches[name], args, (1, 1, 1)), run_dir)
        summaries[name] = summarize(name, run_dir, seconds)
        dirs.append(run_dir)
        print(f"  {name}: {summaries[name].val_losses[-1]:.4f} ({seconds:.0f} s)", flush=True)
    plot_runs(dirs, args.out / "val_vs_flops.png", x="flops", y="val_loss")
    moe = size["moe"]
    lines = [
        f"# convergence_moe: model {size['shape']}, E {moe['moe_experts']}, top_k "
        f"{moe['moe_top_k']}, f_e {moe['moe_ffn_dim']}, r {size['rank']}; dense ffn "
        f"{moe['moe_top_k'] * moe['moe_ffn_dim']}; batch {size['batch']} x {size['seq']}; "
        f"equal training FLOPs (the dense model's {size['dense_steps']} steps); {args.dtype}, "
        f"device {args.device}",
        *moe_table(summaries, {n: b.steps for n, b in plan.items()}),
        "",
        *verdict(summaries),
        f"plot: {args.out}/val_vs_flops.png",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
