"""Every rank's memory per phase, against its floor, for the layouts a user would train.

Each layout is a real ``boostlr train`` run (its own ranks, fresh processes) with
``--train.memory_phases true``: every rank writes its peak per phase (start-up, materialise,
FSDP wrap, optimizer state, forward/backward, step, eval, save) and the tensors it holds.
The floor of a rank is those tensors (parameters, gradients, AdamW moments) plus the runtime
it had before the model existed. CPU ranks sample their resident set; CUDA ranks read
``torch.cuda.max_memory_allocated``. CPU ranks also sample the host allocator's allocated
bytes (``runtime + allocated``: the peak without what the allocator keeps free for reuse);
the plan's prediction is held against that, as it models tensors, not the allocator.

    python benchmarks/memory.py --preset 1B --arch cola --layouts 2x2x2
    python benchmarks/memory.py --preset 130M --layouts 1x1x1 2x2x1 1x2x2 2x2x2 --steps 2
    python benchmarks/memory.py --activations --preset 350M --tp 2 --seq-len 256
    python benchmarks/memory.py --preset 350M --seq-len 64 --steps 2 --max-tensor-ratio 1.4

``--dp-modes fsdp ddp`` runs each layout once per ``parallel.dp_mode`` and holds each run's
peak against its mode's own floor (``mem_floor_<mode>_mb``: the floor plus what the mode
holds by construction, ``boostlr.analysis.dp_choice.mode_held_bytes``), both modes side by
side, with what ``auto`` would pick on this host:

    python benchmarks/memory.py --preset 350M --layouts 2x2x2 --seq-len 64 --steps 2 \
        --dp-modes fsdp ddp

``--activations`` measures, for arch x strategy x act_ckpt at one tp degree, the
forward/backward peak at two batch sizes; their difference over the batch difference is the
activation memory per sequence (the constant parts cancel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

PHASES = (
    "start-up",
    "materialise",
    "FSDP wrap",
    "optimizer state",
    "forward/backward",
    "step",
    "eval",
    "save",
)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def parse_layout(text: str) -> tuple[int, int, int]:
    pp, dp, tp = (int(x) for x in text.split("x"))
    return pp, dp, tp


def run_layout(args: argparse.Namespace, layout: tuple[int, int, int], extra: list[str]) -> dict:
    """Train ``args.steps`` steps plus one eval and one save; each rank's phase report."""
    pp, dp, tp = layout
    run_dir = Path(tempfile.mkdtemp(prefix="boostlr-mem-")) / "run"
    cmd = [
        sys.executable,
        "-m",
        "boostlr.cli",
        "train",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--model.preset",
        args.preset,
        "--model.arch",
        args.arch,
        "--data.seq_len",
        str(args.seq_len),
        "--train.batch_size",
        str(args.batch_size),
        "--train.steps",
        str(args.steps),
        "--train.eval_every",
        str(args.steps),
        "--train.ckpt_every",
        str(args.steps),
        "--data.val_batches",
        "1",
        "--train.dtype",
        args.dtype,
        "--train.memory_phases",
        "true",
        "--parallel.device",
        args.device,
        "--parallel.pp",
        str(pp),
        "--parallel.dp",
        str(dp),
        "--parallel.tp",
        str(tp),
        *(["--data.path", args.data] if args.data else []),
        *(["--model.vocab_size", str(args.vocab)] if args.vocab else []),
        *(["--parallel.microbatches", str(args.microbatches)] if pp > 1 else []),
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    reports = {}
    for path in sorted((run_dir / "memory").glob("rank*.json")):
        reports[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text())
    shutil.rmtree(run_dir.parent, ignore_errors=True)  # a 1B run's checkpoint is GBs
    return {"rc": done.returncode, "stderr": done.stderr[-2000:], "wall_s": wall, "ranks": reports}


def plan_config(args: argparse.Namespace, layout: tuple[int, int, int], extra: list[str]):
    """The run's config as the planner builds it, with the run's vocabulary."""
    from boostlr.config import build_config

    pp, dp, tp = layout
    pairs = [
        ("model.preset", args.preset),
        ("model.arch", args.arch),
        ("data.seq_len", str(args.seq_len)),
        ("train.batch_size", str(args.batch_size)),
        ("train.dtype", args.dtype),
        ("parallel.pp", str(pp)),
        ("parallel.dp", str(dp)),
        ("parallel.tp", str(tp)),
        *([("parallel.microbatches", str(args.microbatches))] if pp > 1 else []),
        *((extra[i].removeprefix("--"), extra[i + 1]) for i in range(0, len(extra), 2)),
    ]
    cfg = build_config(overrides=pairs)
    cfg.model.vocab_size = args.vocab or args.data_vocab
    return cfg


def predicted_mb(args: argparse.Namespace, layout: tuple[int, int, int], extra: list[str]):
    """``boostlr plan``'s memory per pp rank for the same run (no device reserve), MiB."""
    from boostlr.analysis.costmodel import memory_breakdown
    from boostlr.analysis.hardware import load_profile

    pp = layout[0]
    cfg = plan_config(args, layout, extra)
    hw = load_profile("a100-40gb")
    out = {}
    for rank in range(pp):
        parts = memory_breakdown(cfg, hw, rank)
        parts.pop("reserved")
        out[rank] = sum(parts.values()) / 2**20
    return out


def _largest(result: dict, ranks: range, measure) -> float | None:
    values = [measure(result["ranks"][r]) for r in ranks if r in result["ranks"]]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def rss_tensors_mb(report: dict) -> float:
    """Peak resident set less the start-up runtime: tensors plus what the allocator keeps."""
    return max(p["peak_mb"] for p in report["phases"].values()) - report["runtime_mb"]


def allocated_tensors_mb(report: dict) -> float | None:
    """Peak allocated bytes less those at start-up: the tensors (and Python objects) alone."""
    if "runtime_allocated_mb" not in report:
        return None
    peaks = [p["allocated_peak_mb"] for p in report["phases"].values() if "allocated_peak_mb" in p]
    return max(peaks) - report["runtime_allocated_mb"]


def print_vs_plan(result: dict, predicted: dict[int, float], layout: tuple[int, int, int]) -> None:
    """Measured tensor memory of each pipeline stage's largest rank against the plan.

    The plan models tensors, so it is held against the allocator's allocated bytes (the CPU's
    counterpart of ``torch.cuda.max_memory_allocated``); the resident set's peak is shown
    beside it, and their difference is what the allocator kept free for reuse.
    """
    _, dp, tp = layout
    print(
        "| pp rank | RSS peak - runtime (MiB) | allocated peak - runtime (MiB) | plan (MiB) "
        "| plan / allocated |"
    )
    print("|---|---|---|---|---|")
    for pp_rank, plan in predicted.items():
        ranks = range(pp_rank * dp * tp, (pp_rank + 1) * dp * tp)
        rss = _largest(result, ranks, rss_tensors_mb)
        allocated = _largest(result, ranks, allocated_tensors_mb)
        if rss is None:
            continue
        if allocated is None:  # an allocator without counters: the resident set is all there is
            print(f"| {pp_rank} | {rss:,.0f} | - | {plan:,.0f} | ({plan / rss:.2f} of RSS) |")
            continue
        print(
            f"| {pp_rank} | {rss:,.0f} | {allocated:,.0f} | {plan:,.0f} | {plan / allocated:.2f} |"
        )


def floor_mb(report: dict) -> float:
    return report["runtime_mb"] + sum(report["held"].values())


def print_layout(label: str, result: dict) -> None:
    ranks = result["ranks"]
    print(f"\n### {label}: rc {result['rc']}, {result['wall_s']:.0f} s")
    if result["rc"] != 0:
        print(result["stderr"])
    if not ranks:
        return
    phases = [ph for ph in PHASES if any(ph in r["phases"] for r in ranks.values())]
    tail = " | runtime + allocated | held | floor | peak / floor |"
    print("| rank | " + " | ".join(phases) + tail)
    print("|---" * (len(phases) + 5) + "|")
    for rank, r in sorted(ranks.items()):
        peaks = [r["phases"].get(ph, {}).get("peak_mb") for ph in phases]
        cells = [f"{p:,.0f}" if p is not None else "-" for p in peaks]
        peak = max(p for p in peaks if p is not None)
        held = sum(r["held"].values())
        allocated = allocated_tensors_mb(r)
        cells.append("-" if allocated is None else f"{allocated + r['runtime_mb']:,.0f}")
        print(
            f"| {rank} | " + " | ".join(cells) + f" | {held:,.0f} | {floor_mb(r):,.0f} | "
            f"{peak / floor_mb(r):.2f} |"
            if r["held"]
            else f"| {rank} | " + " | ".join(cells) + " | - | - | - |"
        )
    worst = max(
        (max(p["peak_mb"] for p in r["phases"].values()) / floor_mb(r), k)
        for k, r in ranks.items()
        if r["held"]
    )
    print(f"largest rank's peak / floor: {worst[0]:.2f} (rank {worst[1]})")
    tensors = tensor_ratio(ranks)
    if tensors is not None:
        print(f"largest rank's allocated peak / floor: {tensors[0]:.2f} (rank {tensors[1]})")


def tensor_ratio(ranks: dict[int, dict]) -> tuple[float, int] | None:
    """The largest rank's allocated peak over its allocated floor, and that rank.

    The allocated floor is the allocator's bytes at start-up plus the rank's own tensors.
    Unlike the resident set this ratio does not move with the machine's load (the resident
    set keeps what the allocator freed, and how much depends on thread timing); ``None``
    without allocator counters.
    """
    ratios = []
    for rank, r in ranks.items():
        peaks = [p["allocated_peak_mb"] for p in r["phases"].values() if "allocated_peak_mb" in p]
        if not peaks or not r["held"] or "runtime_allocated_mb" not in r:
            continue
        ratios.append((max(peaks) / (r["runtime_allocated_mb"] + sum(r["held"].values())), rank))
    return max(ratios) if ratios else None


def mode_floors(
    args: argparse.Namespace, layout: tuple[int, int, int], extra: list[str]
) -> dict[int, dict[str, float]]:
    """Each rank's bytes by dp mode beyond its shards (ranks laid out tp, then dp, then pp)."""
    from boostlr.analysis.dp_choice import mode_held_bytes

    pp, dp, tp = layout
    cfg = plan_config(args, layout, extra)
    return {
        (pp_rank * dp + d) * tp + t: mode_held_bytes(cfg, pp_rank, t)
        for pp_rank in range(pp)
        for d in range(dp)
        for t in range(tp)
    }


def print_modes(results: dict[str, dict], floors: dict[int, dict[str, float]]) -> None:
    """Each mode's largest rank: peak against the sharded floor and against its own."""
    print(
        "| dp_mode | rank | allocated peak (MiB) | floor | own floor | peak / floor "
        "| peak / own floor | RSS peak | RSS peak / own floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, result in results.items():
        rows = []
        for rank, r in result["ranks"].items():
            peaks = [
                p["allocated_peak_mb"] for p in r["phases"].values() if "allocated_peak_mb" in p
            ]
            if not peaks or not r["held"]:
                continue
            floor = r.get("runtime_allocated_mb", r["runtime_mb"]) + sum(r["held"].values())
            own = floor + floors[rank][mode] / 2**20
            rss = max(p["peak_mb"] for p in r["phases"].values())
            rss_own = floor_mb(r) + floors[rank][mode] / 2**20
            rows.append((max(peaks) / own, rank, max(peaks), floor, own, rss, rss / rss_own))
        if not rows:
            continue
        ratio, rank, peak, floor, own, rss, rss_ratio = max(rows)
        print(
            f"| {mode} | {rank} | {peak:,.0f} | {floor:,.0f} | {own:,.0f} | {peak / floor:.2f} "
            f"| {ratio:.2f} | {rss:,.0f} | {rss_ratio:.2f} |"
        )


def auto_choice(args: argparse.Namespace, layout: tuple[int, int, int], extra: list[str]) -> str:
    """The start line ``boostlr train`` prints for ``dp_mode auto`` here (the trainer's rule)."""
    import torch

    from boostlr.config import PRESETS, resolve
    from boostlr.train.dp_mode import PlanRule

    cfg = plan_config(args, layout, extra)
    rule = PlanRule(torch.device(args.device))
    vocab = cfg.model.vocab_size or PRESETS[cfg.model.preset].vocab_size
    resolve(cfg, SimpleNamespace(vocab_size=vocab), rule)
    return rule.lines()[0] if rule.lines() else "dp_mode auto: decided by the layout"


def activations(args: argparse.Namespace) -> None:
    """Activation MiB per sequence for arch x strategy x act_ckpt at ``--tp``."""
    combos = [
        ("full", "megatron", "none"),
        ("full", "megatron", "block"),
        ("cola", "vanilla", "none"),
        ("cola", "btp", "none"),
        ("cola", "btp", "lowrank"),
        ("cola", "btp", "block"),
    ]
    small, large = args.batch_size, 2 * args.batch_size
    rows = []
    for arch, strategy, ckpt in combos:
        rss, allocated = [], []
        for batch in (small, large):
            ns = argparse.Namespace(**{**vars(args), "arch": arch, "batch_size": batch, "steps": 1})
            extra = ["--parallel.tp_strategy", strategy, "--parallel.act_ckpt", ckpt]
            result = run_layout(ns, (1, 1, args.tp), extra)
            if result["rc"] != 0:
                sys.exit(f"{arch} {strategy} {ckpt} failed:\n{result['stderr']}")
            ranks = result["ranks"].values()
            fb = [r["phases"]["forward/backward"] for r in ranks]
            before = [r["phases"]["optimizer state"]["after_mb"] for r in ranks]
            rss.append(max(f["peak_mb"] - b for f, b in zip(fb, before, strict=True)))
            if all("allocated_peak_mb" in f for f in fb):  # constants cancel in the difference
                allocated.append(max(f["allocated_peak_mb"] for f in fb))
        per_seq_rss = (rss[1] - rss[0]) / (large - small)
        per_seq = (allocated[1] - allocated[0]) / (large - small) if allocated else None
        rows.append((arch, strategy, ckpt, per_seq, per_seq_rss))
        print(f"  measured {arch} {strategy} {ckpt}", file=sys.stderr, flush=True)
    measure = 3 if rows[0][3] is not None else 4  # allocated bytes where the allocator counts
    base = rows[0][measure]
    print(f"\n### activation memory per sequence, tp {args.tp}, {args.preset}, seq {args.seq_len}")
    print("| arch | strategy | act_ckpt | MiB / sequence (allocated) | (RSS) | vs full+megatron |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        arch, strategy, ckpt, per_seq, per_seq_rss = row
        cell = "-" if per_seq is None else f"{per_seq:,.1f}"
        print(
            f"| {arch} | {strategy} | {ckpt} | {cell} | {per_seq_rss:,.1f} | "
            f"{row[measure] / base:.2f} |"
        )


def dataset_vocab(path: str) -> int:
    """The tokenizer's vocabulary of a prepared dataset (0 for the default corpus: preset's)."""
    if not path:
        return 0
    return int(json.loads((Path(path) / "manifest.json").read_text())["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="130M")
    ap.add_argument("--arch", default="cola")
    ap.add_argument("--layouts", nargs="+", default=["2x2x2"], help="PPxDPxTP, e.g. 2x2x2")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", default="", help="a prepared dataset (default: the stdlib corpus)")
    ap.add_argument("--vocab", type=int, default=0, help="model.vocab_size (0: the tokenizer's)")
    ap.add_argument("--activations", action="store_true")
    ap.add_argument(
        "--dp-modes",
        nargs="+",
        default=[],
        choices=["fsdp", "ddp"],
        help="run each layout once per parallel.dp_mode; peaks against each mode's own floor",
    )
    ap.add_argument("--tp", type=int, default=2, help="tp degree of --activations")
    ap.add_argument(
        "--max-tensor-ratio",
        type=float,
        default=0.0,
        help="exit 1 if a layout's allocated peak / allocated floor exceeds this (0: no check)",
    )
    args, extra = ap.parse_known_args()
    print(f"machine: {machine()}; date {time.strftime('%Y-%m-%d')}")
    if args.activations:
        activations(args)
        return
    args.data_vocab = dataset_vocab(args.data)
    if args.dp_modes:
        for text in args.layouts:
            layout = parse_layout(text)
            results = {}
            for mode in args.dp_modes:
                results[mode] = run_layout(args, layout, [*extra, "--parallel.dp_mode", mode])
                label = f"{args.preset} {args.arch} pp x dp x tp = {text}, dp_mode {mode}"
                print_layout(f"{label} {' '.join(extra)}", results[mode])
            print(f"\n### each mode against its own floor, {text}")
            print_modes(results, mode_floors(args, layout, extra))
            print(auto_choice(args, layout, extra))
        return
    for text in args.layouts:
        layout = parse_layout(text)
        result = run_layout(args, layout, extra)
        print_layout(f"{args.preset} {args.arch} pp x dp x tp = {text} {' '.join(extra)}", result)
        if result["ranks"] and args.dtype == "float32":
            print_vs_plan(result, predicted_mb(args, layout, extra), layout)
        tensors = tensor_ratio(result["ranks"])
        if args.max_tensor_ratio and (tensors is None or tensors[0] > args.max_tensor_ratio):
            failed = "no allocator counters" if tensors is None else f"{tensors[0]:.2f}"
            sys.exit(f"{text}: allocated peak / floor {failed} > {args.max_tensor_ratio}")


if __name__ == "__main__":
    main()
