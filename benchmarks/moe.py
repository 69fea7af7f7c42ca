"""MoE under expert parallelism: dense MoE vs CoLA MoE (hidden, latent dispatch) on gloo.

At each ep degree (world = dp = ep, or ``--dp``: ep ranks carved out of dp; real processes)
one run builds the three models through
the engine's build, at one shape and one global batch, and times them in interleaved rounds
so the machine's load hits them alike:

- ``dense MoE``: arch ``full``, every expert a whole SwiGLU MLP, tokens dispatched d wide;
- ``CoLA hidden``: arch ``cola``, every expert a whole CoLA MLP, tokens d wide;
- ``CoLA latent``: arch ``cola``, the experts share ``A_g, A_u, B_d``; a token travels as
  ``[σ(A_g x) | σ(A_u x)]`` (2r) and comes back r wide.

Per model: the ep bytes of one step from the ledger (group ``ep``, the mean over ranks)
against the formula — per routed copy 2d (hidden: d out + d back) or 3r (latent: 2r out +
r back), twice for the backward's reverse all-to-alls, plus the count exchange (the
``[ep, E/ep]`` int64 counts all-gathered, ``ep · E · 8`` bytes per MoE layer, forward only)
— and their ratio, which must be exactly 1; the
median step time (forward, backward, expert-gradient reduction, clipping, AdamW, the
balance-bias update: the trainer's step); the share of it blocked in ep collectives; the
step's CPU seconds summed over the ranks (the work: where ranks outnumber cores, as ep 4 on
two, the step time follows it, not the bytes); the peak host memory of the step per rank
(the rank's parameters and AdamW state plus the highest allocation the step reached above
them, sampled from the allocator; the largest
rank's). Then the issue's goals: CoLA latent's step time over dense MoE's (≤ 0.7 at ep 4)
and over CoLA hidden's (≤ 0.85).

The per-rank bytes depend on the routing (what a rank receives), their sum over the ranks
does not (every copy leaves one rank and arrives at one), hence the mean.

``--baseline-src DIR`` runs every layout a second time with boostlr imported from ``DIR``
(another tree's ``src``, e.g. main's, unpacked with ``git archive``) and prints the two
trees' state and peak memory side by side: the before/after of a change to what a rank
holds.

    python benchmarks/moe.py              # ep 2 and 4, d 512, r 128: a few minutes on 2 cores
    python benchmarks/moe.py --quick      # tiny shapes, one timed step: a check, not a result
    python benchmarks/moe.py --ep 2 --dp 4 --baseline-src /tmp/main/src   # before/after
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from pathlib import Path
from typing import Any

VARIANTS: list[tuple[str, str, str]] = [  # label, arch, moe_dispatch
    ("dense MoE", "full", "hidden"),
    ("CoLA hidden", "cola", "hidden"),
    ("CoLA latent", "cola", "latent"),
]
FP32 = 4
INT64 = 8
# d, layers, heads, E, k, f_e, r, global batch x seq, vocab, rounds x steps
FULL = dict(dim=512, layers=4, heads=8, experts=8, top_k=2, ffn=688, rank=128)
FULL |= dict(batch=8, seq_len=128, vocab=4096, rounds=6, steps=2)
QUICK = dict(dim=64, layers=2, heads=4, experts=4, top_k=2, ffn=32, rank=16)
QUICK |= dict(batch=4, seq_len=32, vocab=512, rounds=1, steps=1)


def variant_config(args: argparse.Namespace, arch: str, dispatch: str, ep: int, dp: int) -> Any:
    """The run config of one variant at ``dp x ep`` (world = dp), ep set past ``validate``.

    ``validate`` refuses ``parallel.ep > 1`` until the trainer runs it, so the config is
    validated at ep 1 and ep is then set on it, as tests/test_moe_ep_build.py does.
    """
    from common import run_config

    overrides: dict[str, Any] = {
        "model.arch": arch,
        "model.dim": args.dim,
        "model.n_layers": args.layers,
        "model.n_heads": args.heads,
        "model.n_kv_heads": args.heads,
        "model.ffn_dim": args.ffn,
        "model.vocab_size": args.vocab,
        "model.moe_experts": args.experts,
        "model.moe_top_k": args.top_k,
        "model.moe_ffn_dim": args.ffn,
        "model.moe_dispatch": dispatch,
        "data.seq_len": args.seq_len,
        "train.batch_size": args.batch // dp,
        "parallel.dp": dp,
        "parallel.ep": ep,
        # Unbounded dropless: every variant moves every routed copy, the formula's bytes. The
        # receive bound (parallel.ep_receive_factor, default 2) binds at ep 4 with E 8, top 2,
        # and would drop other copies in each variant.
        "parallel.ep_receive_factor": 0,
        "parallel.device": "cpu",
    }
    if arch != "full":
        overrides["model.rank"] = args.rank
    from boostlr.config.schema import ParallelConfig

    if "ep_receive_factor" not in ParallelConfig.__dataclass_fields__:  # a --baseline-src
        del overrides["parallel.ep_receive_factor"]  # tree from before the bound: unbounded
    return run_config(overrides)


def formula_bytes(args: argparse.Namespace, dispatch: str, dp: int, ep: int) -> int:
    """ep bytes per rank and step: routed copies x width x fwd+bwd, plus the counts."""
    copies = args.batch // dp * args.seq_len * args.top_k
    width = 3 * args.rank if dispatch == "latent" else 2 * args.dim
    return args.layers * (2 * copies * width * FP32 + ep * args.experts * INT64)


def _rank(args: argparse.Namespace, ep: int, dp: int, src: str | None) -> dict[str, dict[str, Any]]:
    import sys
    import time

    if src is not None:  # the baseline tree: before anything imports boostlr
        sys.path.insert(0, src)

    import torch
    import torch.distributed as dist
    from common import Part, interleave, random_batch

    import boostlr
    from boostlr.models.moe import update_expert_biases
    from boostlr.parallel.launch import init_distributed
    from boostlr.train.host_alloc import allocated_bytes_reader
    from boostlr.train.memory import AllocatedPeak, held_tensor_mb

    if src is not None and not boostlr.__file__.startswith(src):
        raise RuntimeError(f"boostlr came from {boostlr.__file__}, not the baseline {src}")
    device = init_distributed(torch.device("cpu"), dp)
    rank = dist.get_rank()
    parts = {
        label: Part.build(variant_config(args, arch, dispatch, ep, dp), device)
        for label, arch, dispatch in VARIANTS
    }
    b = args.batch // dp
    inputs, targets = random_batch(args.vocab, b, args.seq_len, device, seed=rank)

    def step(part: Part) -> None:
        """The trainer's step at ep > 1 (train/loop.py plus the expert-gradient reduction)."""
        model, optimizer = part.model, part.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss = model.forward_backward(inputs, targets)
        model.reduce_expert_gradients()
        model.global_mean(loss)
        model.clip_gradients(part.cfg.train.grad_clip)
        optimizer.step()
        # The balance bias's update: the trainer's step hook where the tree has step hooks,
        # else (a --baseline-src tree from before them) the call the loop made itself.
        if hasattr(model, "after_optimizer_step"):
            model.after_optimizer_step()
        else:
            dp = model.comms.dp.group if model.comms.dp.size > 1 else None
            update_expert_biases(model.moe_layers(), group=dp)

    results: dict[str, dict[str, Any]] = {
        label: {"bytes": [], "comm": [], "cpu": [], "times": []} for label in parts
    }

    def run(label: str) -> float:
        part = parts[label]
        ledger = part.model.comms.ledger
        ledger.reset()
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        step(part)
        results[label]["cpu"].append(time.process_time() - cpu)  # this process, all threads
        dist.barrier()
        seconds = time.perf_counter() - started
        results[label]["bytes"].append(ledger.totals("ep")["bytes"])
        results[label]["comm"].append(ledger.take_seconds().get("ep", 0.0))
        return seconds

    for label in parts:  # warm-up: not timed
        run(label)
        results[label]["bytes"].clear()
        results[label]["comm"].clear()
        results[label]["cpu"].clear()
    for label, times in interleave(list(parts), run, args.rounds, args.steps).items():
        results[label]["times"] = times

    reader = allocated_bytes_reader()
    for label, part in parts.items():  # memory: one more step each, sampled
        part.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        held = held_tensor_mb(list(part.model.parameters()), part.optimizer)
        results[label]["state_mb"] = held["mem_params_mb"] + held["mem_optim_mb"]
        results[label]["step_mb"] = float("nan")
        dist.barrier()
        if reader is not None:
            sampler = AllocatedPeak(*reader)  # from what is allocated now: the step's rise
            step(part)
            results[label]["step_mb"] = sampler.take_peak_mb() - sampler.runtime_mb
            sampler.stop()
    dist.destroy_process_group()
    return results


def summarize(
    args: argparse.Namespace, dp: int, ep: int, ranks: dict[int, dict]
) -> dict[str, dict]:
    """Per variant, over the ranks: bytes (mean per rank, each step), times, memory."""
    rows = {}
    for label, _, dispatch in VARIANTS:
        per_rank = [ranks[r][label] for r in sorted(ranks)]
        steps = zip(*(r["bytes"] for r in per_rank), strict=True)
        sums = [sum(step) for step in steps]  # every copy leaves one rank and reaches one
        formula = formula_bytes(args, dispatch, dp, ep)
        times = per_rank[0]["times"]  # between barriers: the same step on every rank
        comm = statistics.mean(sum(r["comm"]) / sum(r["times"]) for r in per_rank)
        cpu = [sum(step) for step in zip(*(r["cpu"] for r in per_rank), strict=True)]
        rows[label] = {
            "ledger": [total / dp for total in sums],
            "exact": all(total == formula * dp for total in sums),
            "formula": formula,
            "ratios": [total / (formula * dp) for total in sums],
            "step_s": statistics.median(times),
            "cpu_s": statistics.median(cpu),  # all ranks' CPU seconds in one step
            "comm_share": comm,
            "state_mb": max(r["state_mb"] for r in per_rank),
            "peak_mb": max(r["state_mb"] + r["step_mb"] for r in per_rank),
        }
    return rows


def table(
    args: argparse.Namespace, ep: int, dp: int, rows: dict[str, dict], tree: str = ""
) -> list[str]:
    tokens = args.batch * args.seq_len
    header = (
        f"{'variant':<12} {'ep B/step (ledger)':>19} {'formula':>13} {'ratio':>9} "
        f"{'step s':>7} {'vs dense':>8} {'ep comm':>8} {'CPU s':>6} {'tokens/s':>9} "
        f"{'state MB':>9} {'peak MB':>8}"
    )
    out = [
        f"# moe{tree}: dp {dp} x ep {ep} (world = dp, gloo), d {args.dim}, {args.layers} layers, "
        f"{args.heads} heads, E {args.experts}, top_k {args.top_k}, f_e {args.ffn}, "
        f"r {args.rank}, vocab {args.vocab}, global batch {args.batch} x {args.seq_len} "
        f"({tokens} tokens/step), fp32, {args.rounds}x{args.steps} timed steps per variant",
        header,
        "-" * len(header),
    ]
    dense = rows["dense MoE"]["step_s"]
    for label, r in rows.items():
        worst = max(r["ratios"], key=lambda x: abs(x - 1))
        out.append(
            f"{label:<12} {statistics.mean(r['ledger']):>19,.0f} {r['formula']:>13,} "
            f"{worst:>9.6f} {r['step_s']:>7.3f} {r['step_s'] / dense:>7.2f}x "
            f"{100 * r['comm_share']:>7.1f}% {r['cpu_s']:>6.2f} {tokens / r['step_s']:>9,.0f} "
            f"{r['state_mb']:>9.1f} {r['peak_mb']:>8.1f}"
        )
    latent, hidden = rows["CoLA latent"], rows["CoLA hidden"]
    per_copy = 3 * args.rank / (2 * args.dim)
    payload = [formula_bytes(args, d, dp, ep) - args.layers * ep * args.experts * INT64 for d in
               ("latent", "hidden")]  # fmt: skip
    exact = all(r["exact"] for r in rows.values())
    out += [
        f"ledger = formula in every timed step, every variant: {'yes' if exact else 'NO'}",
        f"bytes per routed copy: latent 3r = {3 * args.rank} vs hidden 2d = {2 * args.dim} "
        f"elements ({per_copy:.3f}x); payload bytes latent/hidden {payload[0] / payload[1]:.3f}",
        goal("CoLA latent / dense MoE step time", latent["step_s"] / dense, 0.7, ep == dp == 4),
        goal("CoLA latent / CoLA hidden step time", latent["step_s"] / hidden["step_s"], 0.85),
        f"CoLA latent / CoLA hidden CPU time, all ranks: {latent['cpu_s'] / hidden['cpu_s']:.2f} "
        f"(the step's work; with more ranks than the {os.cpu_count()} cores the step time "
        "follows it)",
    ]
    return out


def memory_table(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """The baseline tree's state and worst-rank peak against this tree's, per variant."""
    header = (
        f"{'variant':<12} {'state MB before':>15} {'after':>8} {'peak MB before':>14} "
        f"{'after':>8} {'peak after/before':>17}"
    )
    out = ["# memory, worst rank: baseline tree (before) vs this tree (after)", header]
    out.append("-" * len(header))
    for label in after:
        b, a = before[label], after[label]
        out.append(
            f"{label:<12} {b['state_mb']:>15.1f} {a['state_mb']:>8.1f} {b['peak_mb']:>14.1f} "
            f"{a['peak_mb']:>8.1f} {a['peak_mb'] / b['peak_mb']:>17.3f}"
        )
    return out


def goal(what: str, ratio: float, target: float, applies: bool = True) -> str:
    verdict = ("met" if ratio <= target else "NOT met") if applies else "set at ep 4"
    return f"{what}: {ratio:.2f} (goal <= {target}: {verdict})"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: ep)")
    parser.add_argument(
        "--baseline-src", default=None, help="another tree's src: its memory side by side"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a check, seconds")
    for key, value in FULL.items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(flag, type=int, default=None, help=f"default {value}")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for ep in args.ep:
        dp = args.dp or ep
        if args.experts % ep or args.batch % dp or dp % ep:
            parser.error(
                f"--experts {args.experts} must divide by ep {ep}, --batch {args.batch} by "
                f"dp {dp}, dp by ep"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from common import machine

    from boostlr.parallel.launch import launch
    from boostlr.train.host_alloc import allocator_env

    env = allocator_env(True, "cpu")  # the trainer's CPU allocator (jemalloc where installed)
    print(machine(), flush=True)
    for ep in args.ep:
        dp = args.dp or ep
        rows = summarize(args, dp, ep, launch(dp, _rank, args, ep, dp, None, env=env))
        print("\n" + "\n".join(table(args, ep, dp, rows)), flush=True)
        if args.baseline_src:
            src = str(Path(args.baseline_src).resolve())
            before = summarize(args, dp, ep, launch(dp, _rank, args, ep, dp, src, env=env))
            print("\n" + "\n".join(table(args, ep, dp, before, f" ({src})")), flush=True)
            print("\n" + "\n".join(memory_table(before, rows)), flush=True)
    print(
        "\nstep: forward, backward, expert-gradient reduction, clipping, AdamW, bias update; "
        "median of the timed steps. ratio: ledger / formula, the step furthest from 1. "
        "CPU s: the step's CPU seconds summed over the ranks (each process, all its threads), "
        "median. peak MB: the rank's parameters and AdamW state plus the step's highest allocation "
        "above them (sampled from the allocator every ms), the largest rank's."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
