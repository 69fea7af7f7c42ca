"""BOOST's memory claim at scale, traced: the largest micro-batch per rank, and weak scaling.

Each number comes from ``boostlr plan CONFIG --trace --json`` (the trainer itself, one rank of
a role, two steps on fake tensors in a fake world of the layout's size) at bf16, sequence 4096
and BOOST's accumulation (4 micro-batches, or 4 pipeline micro-batches under a pipeline).

*Largest micro-batch* (sequences of 4096 tokens per micro-batch; under a pipeline, per
pipeline micro-batch): for a fixed layout the traced peak is affine in the micro-batch size,
so the heaviest rank is traced at 1 and 2 sequences and the line through the two device
totals (tensor peak + the named CUDA terms of ``boostlr/trace/compare.py``) is solved for
40 GiB and 80 GiB (the A100-40GB's 40960 MiB and the A100-80GB's 81920 MiB). ``--confirm
NAME MB`` traces the heaviest rank at MB to check a boundary. The plan's own answer (its
``fits``: the breakdown plus the profile's reserve against the profile's memory) is beside it.

*Weak scaling*: the BOOST paper's series (1B on 1 GPU ... 40B on 64), each at its layout:
the traced peak of the heaviest traced rank and the planned step time of the three strategies.

    python benchmarks/scale_tables.py --out /tmp/traces          # traces what is missing
    python benchmarks/scale_tables.py --out /tmp/traces --no-run # tables from saved traces

Traces are saved as ``OUT/NAME.json`` (the command's whole ``--json`` output) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

GIB = 1 << 30
CARDS = {"40 GiB": ("a100-40gb", 40 * GIB), "80 GiB": ("a100-80gb", 80 * GIB)}
LAYOUTS = {  # size: (gpus, overrides that make the 13B sibling configs this size), per arch
    "7B": (4, []),
    "13B": (8, []),
    "30B": (16, ["--model.preset", "30B", "--parallel.pp", "4"]),
}
CONFIGS = {
    ("7B", "full"): "configs/llama_7b_tp4_full.toml",
    ("7B", "vanilla"): "configs/cola_7b_tp4_vanilla.toml",
    ("7B", "btp"): "configs/cola_7b_tp4_btp.toml",
    **{
        (size, arch): f"configs/{conf}"
        for size in ("13B", "30B")
        for arch, conf in (
            ("full", "llama_13b_tp4_pp2_full.toml"),
            ("vanilla", "cola_13b_tp4_pp2_vanilla.toml"),
            ("btp", "cola_13b_tp4_pp2_btp.toml"),
        )
    },
}
ARCH_TAG = {"full": "f", "vanilla": "v", "btp": "b"}


def micro_args(size: str, mb: int, accum: int = 4) -> list[str]:
    """BOOST's micro-batching at ``mb`` sequences per micro-batch."""
    if size == "7B":  # no pipeline: accum micro-batches of mb sequences
        return ["--train.batch_size", str(mb), "--train.global_batch", str(accum * mb)]
    pipe = ["--parallel.microbatches", "4", "--train.batch_size", str(4 * mb)]
    return [*pipe, "--train.global_batch", str(4 * mb)]


def case_args(size: str, arch: str, mb: int) -> list[str]:
    """The ``plan`` arguments of one traced case (the saved traces were made with these)."""
    gpus, extra = LAYOUTS[size]
    args = [CONFIGS[size, arch], "--gpus", str(gpus), *extra]
    # The mb-2 traces of a layout without a pipeline accumulate 2 micro-batches (gradients
    # are held from the second on, so the peak is the same as with 4); pipelines trace
    # only rank 0 at mb 2 (the first stage: the heaviest at mb 1 in every layout traced),
    # and btp's only rank 0 at mb 1 too (all its stages were traced before: RESULTS.md).
    if mb == 1:
        one = ["--trace-rank", "0"] if arch == "btp" and size != "7B" else []
        return [*args, *micro_args(size, 1), *one]
    if size == "7B":
        return [*args, *micro_args(size, mb, 4 if (arch == "btp" and mb == 2) else 2)]
    return [*args, *micro_args(size, mb), "--trace-rank", "0"]


WEAK = {  # the BOOST paper's weak-scaling series, CoLA + BTP at BOOST's micro-batching
    "1B": ["configs/cola_7b_tp4_btp.toml", "--gpus", "1", "--model.preset", "1B",
           "--parallel.tp", "1", *micro_args("7B", 1)],
    "3B": ["configs/cola_3b_tp2_btp.toml", "--gpus", "2", *micro_args("7B", 1)],
    "7B": case_args("7B", "btp", 1),
    "13B": case_args("13B", "btp", 1),
    "30B": case_args("30B", "btp", 1),
    # 64 GPUs: tp4 pp4 dp4, 4 pipeline micro-batches of one sequence per dp rank
    "40B": ["configs/cola_40b_tp4_pp4_btp.toml", "--gpus", "64", "--train.batch_size", "4",
            "--parallel.microbatches", "4", "--train.global_batch", "16"],
}  # fmt: skip


def traced(name: str, args: list[str], out: Path, run: bool) -> dict | None:
    """The saved ``plan --trace --json`` output of ``name``, or a fresh one."""
    path = out / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not run:
        return None
    cmd = [sys.executable, "-m", "boostlr.cli", "plan", *args, "--hardware", "a100-40gb"]
    cmd += ["--trace", "--json"]
    print("running:", " ".join(cmd[2:]), file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    path.write_text(res.stdout)
    return json.loads(res.stdout)


def heaviest(data: dict) -> dict:
    return max(data["trace"], key=lambda e: e["device_bytes"])


def plan_config(args: list[str]):
    """The resolved config ``boostlr plan`` reads from ``args`` (config, --gpus, overrides)."""
    from boostlr.analysis import plan
    from boostlr.analysis.costmodel import planning_config
    from boostlr.config import parse_overrides

    conf, _, gpus = args[:3]
    pairs = parse_overrides(_strip_trace_rank(args[3:]))
    return planning_config(plan.load_config(conf, pairs, int(gpus), False))


def _strip_trace_rank(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--trace-rank":
            skip = True
        else:
            out.append(a)
    return out


def plan_peak(cfg, stage: int, hw_name: str = "a100-40gb") -> float:
    """The plan's tensor bytes of a pipeline rank (its breakdown less the lumped reserve)."""
    from boostlr.analysis.costmodel import memory_breakdown
    from boostlr.analysis.hardware import load_profile

    bd = memory_breakdown(cfg, load_profile(hw_name), stage)
    return sum(v for k, v in bd.items() if k != "reserved")


def plan_largest(size: str, arch: str, hw_name: str) -> int:
    """The largest micro-batch the plan says fits (its ``fits``, the reserve included)."""
    from boostlr.analysis.costmodel import memory_breakdown
    from boostlr.analysis.hardware import load_profile

    hw = load_profile(hw_name)
    best = 0
    for mb in range(1, 65):
        cfg = plan_config(case_args(size, arch, 1)[:3] + LAYOUTS[size][1] + micro_args(size, mb))
        worst = max(sum(memory_breakdown(cfg, hw, s).values()) for s in range(cfg.parallel.pp))
        if worst > hw.memory:
            break
        best = mb
    return best


def largest_table(out: Path, run: bool, confirm: dict[str, int]) -> list[str]:
    lines = [
        "| model, layout | arch | heaviest rank | device GiB at mb 1 / 2 | GiB per sequence "
        "| largest mb, 40 GiB: trace (plan) | largest mb, 80 GiB: trace (plan) | confirmed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in LAYOUTS:
        for arch in ("full", "vanilla", "btp"):
            name = f"{ARCH_TAG[arch]}{size[:-1]}"
            one = traced(f"{name}_mb1", case_args(size, arch, 1), out, run)
            two = traced(f"{name}_mb2", case_args(size, arch, 2), out, run)
            if one is None or two is None:
                lines.append(f"| {size} | {arch} | not traced | | | | | |")
                continue
            h1 = heaviest(one)
            h2 = next(e for e in two["trace"] if e["rank"] == h1["rank"])
            d1, d2 = h1["device_bytes"], h2["device_bytes"]
            slope = d2 - d1
            cells = []
            for hw_name, cap in CARDS.values():
                mb = 0 if d1 > cap else 1 + int((cap - d1) // slope)
                cells.append(f"{mb} ({plan_largest(size, arch, hw_name)})")
            check = ""
            if name in confirm:
                mb = confirm[name]
                data = traced(f"{name}_mb{mb}", case_args(size, arch, mb), out, run)
                if data is not None:
                    got = next(e for e in data["trace"] if e["rank"] == h1["rank"])
                    line = d1 + slope * (mb - 1)
                    check = f"mb {mb}: {got['device_bytes'] / GIB:.2f} (line {line / GIB:.2f})"
            layout = {"7B": "tp4", "13B": "tp4 pp2", "30B": "tp4 pp4"}[size]
            lines.append(
                f"| {size} {layout} | {arch} | {h1['rank']} (pp {h1['pp_stage']}) | "
                f"{d1 / GIB:.2f} / {d2 / GIB:.2f} | {slope / GIB:.2f} | "
                f"{cells[0]} | {cells[1]} | {check} |"
            )
    return lines


def weak_table(out: Path, run: bool) -> list[str]:
    from boostlr.analysis import plan
    from boostlr.analysis.hardware import load_profile

    hw = load_profile("a100-40gb")
    lines = [
        "| model | GPUs | layout | traced peak GiB (rank) | +CUDA GiB | plan GiB | "
        "planned step s: full / vanilla / btp | btp speed-up vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, args in WEAK.items():
        cfg = plan_config(args)
        p = cfg.parallel
        rows = {r.strategy: r for r in plan.strategy_rows(cfg, hw)}
        times = " / ".join(
            f"{rows[s].step_time:.3f}" if s in rows else "-" for s in ("megatron", "vanilla", "btp")
        )
        speed = rows["megatron"].step_time / rows["btp"].step_time
        layout = f"tp{p.tp} pp{p.pp} dp{p.dp}"
        data = traced(f"b{size[:-1]}_mb1", args, out, run)
        if data is None:
            lines.append(f"| {size} | {p.world_size} | {layout} | not traced | | | {times} | |")
            continue
        h = heaviest(data)
        planned = plan_peak(cfg, h["pp_stage"])
        lines.append(
            f"| {size} | {p.world_size} | {layout} | {h['peak_bytes'] / GIB:.2f} ({h['rank']}) | "
            f"{h['device_bytes'] / GIB:.2f} | {planned / GIB:.2f} | {times} | {speed:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("scale_traces"), help="saved traces")
    ap.add_argument("--no-run", action="store_true", help="only tables of saved traces")
    ap.add_argument(
        "--confirm", nargs=2, action="append", default=[], metavar=("NAME", "MB"),
        help="also trace case NAME (e.g. v7: vanilla 7B) at MB sequences per micro-batch",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    confirm = {name: int(mb) for name, mb in args.confirm}
    print("## Largest micro-batch per rank (sequences of 4096 tokens), traced\n")
    print("\n".join(largest_table(args.out, not args.no_run, confirm)))
    print("\n## Weak scaling, CoLA + BTP (traced memory per rank, planned step time)\n")
    print("\n".join(weak_table(args.out, not args.no_run)))


if __name__ == "__main__":
    main()
