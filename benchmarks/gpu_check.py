"""One command for a lent GPU machine that exercises the whole trainer; a CPU dry run for CI.

On the lent H200 (its own ``python3`` and torch 2.11, no registry, nothing to install), from
the repository root or any other folder::

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out /tmp/check
    PYTHONPATH=src python3 benchmarks/gpu_check.py --device cpu --out /tmp/check   # CI's dry run

(``PYTHONPATH`` may be left out: the script puts its own tree's ``src`` first on its path and
on every step's; docs/speed-and-memory.md has the whole device command, reports brought
back.) Everything lands under ``--out DIR``: the runs, the export, logs,
``gpu_check.json`` (every check with ``ok`` true, false or null for skipped) and
``gpu_check.md`` (the same as a table). The checks share ``--budget-s`` (540 s: the whole run,
compilation included, fits a 10-minute call, so a 15-minute lease leaves room for a rerun); one
that the budget cannot fit is *skipped (budget)*, never failed, and the most informative run
first. Each step runs as its own process group, killed whole on a timeout
(``gpu_check_run.py``). In order:

1. On CUDA, the counter-based init's draws on the GPU against the CPU's (bit for bit).
2. ``torchrun --nproc-per-node 1 -m boostlr.cli train`` (bf16, ``train.compile``,
   ``act_ckpt lowrank``, ``async_ckpt``, eval and a checkpoint every ``--every`` steps) on the
   default corpus (or ``--data``), through the rank wrapper (``gpu_check_rank.py``): strict
   determinism, host syncs per step (steps that log, evaluate or save, and the first two, where
   graphs are captured, may sync; the others must not), and on CUDA which thread makes each
   ``torch.cuda`` call (each must come from a thread that set the rank's device).
3. The run's first metrics row: ``build_s``, tokens/s, MFU (measured under strict
   determinism); its per-phase memory against ``boostlr plan``'s prediction.
4. Every collective of a pp2 x dp2 x tp2 step, each rank traced in a fake world on the
   device's tensors, paired across ranks: equal element counts and dtypes
   (``gpu_collectives.py``).
5. A copy of the run cut back to its middle checkpoint, continued with ``--resume``: every
   loss after the cut equals the uninterrupted run's bit for bit. Both runs are under
   ``torch.use_deterministic_algorithms(True)`` (no ``warn_only``) and
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; with ``--no-deterministic`` the check only reports the
   largest relative difference (bf16 attention backward is not deterministic otherwise).
6. ``boostlr export`` of the result and ``boostlr eval`` of the export and of the run dir.
7. ``benchmarks/gpu_suite.py`` (GEMMs, one-GPU steps) in what is left of the budget.
8. With two or more GPUs, the distributed tests on NCCL (``BOOSTLR_TEST_BACKEND=nccl``).

Exits 1 when a check fails (a skipped one does not fail), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from gpu_check_more import (
    check_collectives,
    check_data,
    check_export_eval,
    check_init_devices,
    check_nccl,
    check_suite,
)
from gpu_check_rank import rank_train
from gpu_check_run import CAPS, Checks, read_rows, step_env, tail, use_own_tree

RANK_ENTRY = "_rank_train"  # argv[1] of the wrapper torchrun starts
WARMUP_STEPS = 2  # compiled graphs are captured in the first two steps


def train_overrides(args: argparse.Namespace) -> list[str]:
    every = args.every
    pairs = {
        "model.preset": args.preset,
        "model.arch": "cola",
        "data.seq_len": args.seq_len,
        "train.batch_size": args.batch_size,
        "train.steps": args.steps,
        "train.warmup": max(1, args.steps // 10),
        "train.dtype": "bfloat16",
        "train.compile": str(args.compile).lower(),
        "train.async_ckpt": "true",
        "train.log_every": args.log_every,
        "train.eval_every": every,
        "train.ckpt_every": every,
        "train.keep_checkpoints": args.steps // every + 1,
        "train.memory_phases": "true",
        "data.val_batches": 2,
        "parallel.device": args.device,
        "parallel.tp_strategy": "btp",
        "parallel.act_ckpt": "lowrank",
    }
    if args.data:
        pairs["data.path"] = args.data
    return [x for k, v in pairs.items() for x in (f"--{k}", str(v))]


def torchrun(args: argparse.Namespace, entry: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(args.port),
        *entry,
    ]


def rank_entry(args: argparse.Namespace, report: Path) -> list[str]:
    """The rank wrapper's argv: this script, the entry word, its report, the determinism."""
    mode = "strict" if args.deterministic else "default"
    return [str(Path(__file__).resolve()), RANK_ENTRY, str(report), mode]


def quiet_steps(args: argparse.Namespace) -> list[int]:
    """Steps that neither log, evaluate nor save, after the compile warm-up."""

    def busy(s: int) -> bool:
        return s % args.log_every == 0 or s % args.every == 0 or s == args.steps

    return [s for s in range(WARMUP_STEPS + 1, args.steps) if not busy(s)]


TRAIN = "train (torchrun, bf16, compile, lowrank ckpt, async ckpt)"
AFTER_TRAIN = (
    "no host sync on quiet steps",
    "CUDA calls only from threads that set the rank's device",
    "start-up (build_s in the first metrics row)",
    "speed",
    "memory per phase vs boostlr plan",
    "resume bit for bit (torchrun --resume)",
    "export",
)


def check_train(args: argparse.Namespace, checks: Checks, run_dir: Path) -> bool:
    report = checks.out / "rank_train.json"
    entry = rank_entry(args, report)
    cmd = torchrun(args, [*entry, "train", "--run-dir", str(run_dir), "--quiet"])
    cmd += train_overrides(args)
    log = checks.out / "train.log"
    step = checks.step(cmd, log, CAPS["train"], step_env(args.deterministic))
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    ok = step.rc == 0 and rows and rows[-1]["step"] == args.steps
    if step.rc == 124:
        checks.timed_out(TRAIN, step, log)
        ok = False
    else:
        detail = (
            f"exit {step.rc}, {len(rows)} loss rows to step {rows[-1]['step'] if rows else '-'}"
        )
        checks.add(TRAIN, bool(ok), detail if ok else f"{detail}: {tail(log)}", step.seconds)
    if not ok:
        for name in AFTER_TRAIN:
            checks.add(name, None, "not run: needs the training run")
        return False
    ranked = json.loads(report.read_text()) if report.exists() else {}
    checks.facts["determinism"] = ranked.get("deterministic")
    check_syncs(args, checks, ranked.get("syncs"))
    check_cuda_threads(checks, ranked)
    first = rows[0]
    build_s = first.get("build_s")
    checks.facts["first_row"] = first
    checks.add(
        AFTER_TRAIN[2],
        isinstance(build_s, float | int),
        f"build {build_s} s per rank {first.get('build_s_ranks')}",
    )
    last = rows[-1]
    mfu = last.get("mfu")
    checks.facts["speed"] = {"tokens_per_s": last["tokens_per_s"], "mfu": mfu}
    mfu_text = f", MFU {mfu:.1%}" if mfu is not None else " (no peak FLOP/s for this device)"
    mode = checks.facts["determinism"] or {}
    strict = " under strict determinism" if mode.get("enabled") and not mode["warn_only"] else ""
    checks.add(
        "speed",
        last["tokens_per_s"] > 0 and (mfu is None or 0 < mfu < 1),
        f"{last['tokens_per_s']:,.0f} tokens/s{mfu_text}{strict}, loss {rows[0]['loss']:.3f} "
        f"-> {last['loss']:.3f}",
    )
    check_memory(args, checks, run_dir)
    return True


def check_syncs(args: argparse.Namespace, checks: Checks, per_step: dict | None) -> None:
    name = AFTER_TRAIN[0]
    if per_step is None:
        checks.add(name, False, "the rank wrapper's report was not written")
        return
    quiet = quiet_steps(args)
    main = {s: {k: n for k, n in c.items() if "background" not in k} for s, c in per_step.items()}
    bad = {s: main[str(s)] for s in quiet if main.get(str(s))}
    busy = {int(s): c for s, c in per_step.items() if int(s) > 0 and int(s) not in quiet}
    what = "sync-debug warnings and conversions" if args.device == "cuda" else "conversions"
    detail = f"{len(quiet)} quiet steps, {what}: " + (f"{bad}" if bad else "none")
    if not quiet:
        checks.add(name, None, "no quiet step: raise --steps")
    elif not busy:
        checks.add(name, False, "nothing counted at all: not wired")
    else:
        checks.add(name, not bad, detail)


def check_cuda_threads(checks: Checks, report: dict, run: str = "") -> None:
    """Every recorded ``torch.cuda`` call came from a thread that had set the rank's device."""
    name = AFTER_TRAIN[1] + run
    seen = [report["cuda_threads"]] if report.get("cuda_threads") else []
    if not seen:
        checks.add(name, None, "CUDA only (tests/test_gpu_check.py tests the recorder)")
        return
    calls = sum(row["count"] for r in seen for row in r["calls"])
    unset = [row for r in seen for row in r["unset"]]
    others = sorted({t for r in seen for t in r["other_threads"]})
    checks.facts.setdefault("cuda_threads", []).extend(seen)
    detail = f"{calls} calls, threads besides the main one: {others or 'none'}"
    if unset:
        what = [(u["thread"], u["call"], u["count"]) for u in unset[:6]]
        detail += f"; before setting the device (device 0 on every node): {what}"
    checks.add(name, not unset, detail)


def check_memory(args: argparse.Namespace, checks: Checks, run_dir: Path) -> None:
    """Each phase's peak (tensor bytes: CUDA allocated, CPU allocator) against the plan."""
    from boostlr.analysis.costmodel import memory_breakdown
    from boostlr.analysis.hardware import load_profile
    from boostlr.config import build_config
    from boostlr.train.perf import gpu_profile_name

    path = run_dir / "memory" / "rank0.json"
    if not path.exists():
        checks.add("memory per phase vs boostlr plan", False, f"{path} was not written")
        return
    report = json.loads(path.read_text())
    cfg = build_config(run_dir / "config.toml", saved=True)
    name = "h100-sxm"
    if args.device == "cuda":
        import torch

        name = gpu_profile_name(torch.cuda.get_device_name()) or name
    parts = memory_breakdown(cfg, load_profile(name), 0)
    parts.pop("reserved", None)
    plan_mb = sum(parts.values()) / 2**20
    key = "allocated_peak_mb" if args.device == "cpu" else "peak_mb"
    base = report.get("runtime_allocated_mb" if args.device == "cpu" else "runtime_mb", 0.0)
    phases = {
        ph: round(row.get(key, row["peak_mb"]) - base, 1) for ph, row in report["phases"].items()
    }
    peak = max(phases.values())
    checks.facts["memory"] = {"plan_mb": round(plan_mb, 1), "phases_mb": phases, "plan": parts}
    needed = {"materialise", "optimizer state", "forward/backward", "step", "eval", "save"}
    missing = needed - set(phases)
    detail = (
        f"peak {peak:,.0f} MiB ({max(phases, key=phases.get)}) vs plan {plan_mb:,.0f} MiB "
        f"({peak / plan_mb:.2f}x); phases " + ", ".join(f"{k} {v:,.0f}" for k, v in phases.items())
    )
    if missing:
        detail = f"phases missing: {sorted(missing)}; {detail}"
    checks.add("memory per phase vs boostlr plan", not missing, detail)


def check_resume(args: argparse.Namespace, checks: Checks, run_dir: Path, cut: Path) -> bool:
    """Continue a copy cut back to the middle checkpoint: the same losses, bit for bit."""
    name = AFTER_TRAIN[5]
    ckpts = sorted(
        int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
    )
    middle = [s for s in ckpts if 0 < s < args.steps]
    if not middle:
        return checks.add(name, False, f"no middle checkpoint among {ckpts}")
    mid = min(middle, key=lambda s: abs(s - args.steps / 2))
    shutil.copytree(run_dir, cut)
    for p in (cut / "checkpoints").glob("step_*"):
        if int(p.name.removeprefix("step_")) > mid:
            shutil.rmtree(p)
    report = checks.out / "rank_resume.json"
    entry = [*rank_entry(args, report), "train", "--run-dir", str(cut), "--resume", "--quiet"]
    log = checks.out / "resume.log"
    step = checks.step(torchrun(args, entry), log, CAPS["resume"], step_env(args.deterministic))
    if step.rc == 124:
        checks.timed_out(name, step, log)
        return False
    if report.exists() and args.device == "cuda":  # restoring runs other code than saving
        check_cuda_threads(checks, json.loads(report.read_text()), " (resume)")

    def after(rows: list[dict]) -> dict[tuple[int, str], float]:
        keys = ("loss", "val_loss", "grad_norm")
        return {(r["step"], k): r[k] for r in rows if r["step"] > mid for k in keys if k in r}

    want, got = after(read_rows(run_dir)), after(read_rows(cut))
    # The continued run also logs its first step; every value both logged must be equal.
    differ = sorted(k for k in want if got.get(k) != want[k])
    detail = f"exit {step.rc}, from step {mid}: {len(want)} values compared"
    mode = checks.facts.get("determinism") or {}
    detail += (
        f" (deterministic algorithms {mode.get('enabled')}, warn_only {mode.get('warn_only')}, "
        f"CUBLAS_WORKSPACE_CONFIG {mode.get('cublas_workspace_config')})"
    )
    checks.facts["resume"] = {"from_step": mid, "compared": len(want), "differ": len(differ)}
    if step.rc != 0 or not want:
        return checks.add(name, False, f"{detail}: {tail(log)}", step.seconds)
    if not args.deterministic:
        worst = max(
            (abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in differ if k in got),
            default=0.0,
        )
        detail += f"; not bitwise (--no-deterministic): {len(differ)} differ, worst rel {worst:.2e}"
        return checks.add(name, None if differ else True, detail, step.seconds)
    if differ:
        detail += f"; differ at {differ[:4]}: {[(want[k], got.get(k)) for k in differ[:2]]}"
    return checks.add(name, not differ, detail, step.seconds)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for everything (new)")
    ap.add_argument("--data", default=None, help="prepared dataset (default: default corpus)")
    ap.add_argument("--preset", default=None, help="default: 350M on CUDA, tiny on CPU")
    ap.add_argument("--steps", type=int, default=None, help="default: 30 on CUDA, 12 on CPU")
    ap.add_argument("--every", type=int, default=None, help="eval + checkpoint interval")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--eval-tokens", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=540, help="wall-clock budget, seconds")
    ap.add_argument("--suite-budget-s", type=float, default=120)
    ap.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train and resume under use_deterministic_algorithms(True) (default: on)",
    )
    ap.add_argument("--port", type=int, default=None, help="torchrun's (default: a free one)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {
        "preset": "350M" if cuda else "tiny",
        "steps": 30 if cuda else 12,
        "every": 10 if cuda else 4,
        "log_every": 5 if cuda else 4,
        "seq_len": 1024 if cuda else 32,
        "batch_size": 8 if cuda else 4,
        "compile": cuda,  # inductor's C++ build costs minutes on a small CPU
        "eval_tokens": 65536 if cuda else 2048,
    }
    if args.port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.data:
        args.data = str(Path(args.data).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    use_own_tree()
    if argv[:1] == [RANK_ENTRY]:
        return rank_train(Path(argv[1]), argv[3:], strict=argv[2] == "strict")
    args = parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device visible: use --device cpu for the dry run")
        return 2
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"gpu_check: error: {out} is not empty: pass a new --out folder")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks(out, args.budget_s)
    checks.facts["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    checks.facts["machine"] = machine_line(torch)
    import boostlr

    checks.facts["boostlr"] = str(Path(boostlr.__file__).resolve().parent)
    print(checks.facts["machine"], flush=True)
    try:
        run_dir = out / "run"
        check_init_devices(args, checks)
        trained = check_data(args, checks) and check_train(args, checks, run_dir)
        check_collectives(args, checks)
        if trained and check_resume(args, checks, run_dir, out / "resumed"):
            check_export_eval(args, checks, out / "resumed")
        elif trained:
            checks.add("export", None, "not run: needs the resumed run")
        check_suite(args, checks)
        check_nccl(args, checks)
    finally:
        checks.write()
    return 0 if checks.passed else 1


def machine_line(torch) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"{gpu} x {count}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
