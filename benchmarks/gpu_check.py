"""One command for a lent GPU machine that exercises the whole trainer; a CPU dry run for CI.

Everything lands under ``--out DIR``: the runs, the export, ``gpu_check.json`` (every check
with ``ok`` true, false or null for skipped) and ``gpu_check.md`` (the same as a table).
In order:

1. ``torchrun --nproc-per-node 1 -m boostlr.cli train`` (bf16, ``train.compile``,
   ``act_ckpt lowrank``, ``async_ckpt``, eval and a checkpoint every ``--every`` steps) on the
   default corpus (or ``--data``), through a wrapper that counts host syncs per step: under
   ``torch.cuda.set_sync_debug_mode("warn")`` on CUDA, and the ``.item()``-style conversions
   (the CPU proxy ``tests/test_host_syncs.py`` counts) on both. Steps that log, evaluate or
   save, and the first two (graphs are captured there), may sync; the others must not.
2. The run's first metrics row: ``build_s`` (start-up), tokens/s, MFU; its per-phase memory
   (``train.memory_phases``) against ``boostlr plan``'s prediction for the same config.
3. A copy of the run cut back to its middle checkpoint, continued with ``--resume``: every
   loss and validation loss after the cut equals the uninterrupted run's bit for bit.
4. ``boostlr export`` of the result and ``boostlr eval`` of the export and of the run dir.
5. On CUDA, the counter-based init's draws on the GPU against the CPU's (bit for bit), and
   ``benchmarks/gpu_suite.py`` (GEMMs, one-GPU steps) in what is left of the budget.
6. With two or more GPUs, the distributed tests on NCCL (``BOOSTLR_TEST_BACKEND=nccl``).

Exits 1 when a check fails (a skipped one does not fail), 2 on bad arguments.

    python benchmarks/gpu_check.py --out /tmp/check                 # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --out /tmp/check    # the dry run (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANK_ENTRY = "_rank_train"  # argv[1] of the wrapper torchrun starts
CONVERSIONS = ("item", "__float__", "__bool__", "tolist", "__int__")
WARMUP_STEPS = 2  # compiled graphs are captured in the first two steps


# ----------------------------------------------------------------------------- the rank


def rank_train(syncs_path: Path, argv: list[str]) -> int:
    """``boostlr.cli.main(argv)`` in this torchrun rank, counting host syncs per step."""
    import torch

    from boostlr.cli import main
    from boostlr.train.profiling import StepProfiler

    counts: dict[int, Counter] = {}
    current = {"step": 0}
    main_thread = threading.main_thread()

    def count(kind: str) -> None:
        # Another thread (the async checkpoint writer) does not hold up the step's queue.
        where = "" if threading.current_thread() is main_thread else " (background thread)"
        counts.setdefault(current["step"], Counter())[kind + where] += 1

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            count(name)
            return original(self, *args, **kwargs)

        return original, wrapper

    originals = {}
    for name in CONVERSIONS:
        originals[name], wrapper = counting(name)
        setattr(torch.Tensor, name, wrapper)
    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        current["step"] = step
        before_step(self, step)

    StepProfiler.before_step = mark
    synchronize = torch.cuda.synchronize

    def counted_sync(*args, **kwargs):
        count("cuda.synchronize")
        return synchronize(*args, **kwargs)

    torch.cuda.synchronize = counted_sync
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            count("sync_debug")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    if torch.cuda.is_available():
        warnings.filterwarnings("always", message=".*synchronizing.*")
        torch.cuda.set_sync_debug_mode("warn")
    try:
        return main(argv)
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        StepProfiler.before_step = before_step
        torch.cuda.synchronize = synchronize
        warnings.showwarning = shown
        report = {str(step): dict(c) for step, c in sorted(counts.items())}
        syncs_path.write_text(json.dumps(report, indent=1))


# ----------------------------------------------------------------------------- the checks


class Checks:
    """The checks so far, each with its outcome, a detail line and its seconds."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.facts: dict[str, Any] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def add(self, name: str, ok: bool | None, detail: str, seconds: float = 0.0) -> bool:
        self.rows.append({"check": name, "ok": ok, "detail": detail, "seconds": seconds})
        mark = {True: "ok", False: "FAIL", None: "skip"}[ok]
        print(f"[{mark:>4}] {name}: {detail}", flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(r["ok"] is not False for r in self.rows)

    def write(self) -> None:
        report = {
            "passed": self.passed,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "checks": self.rows,
            **self.facts,
        }
        (self.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        lines = ["| check | result | seconds | detail |", "|---|---|---|---|"]
        for r in self.rows:
            mark = {True: "ok", False: "FAIL", None: "skipped"}[r["ok"]]
            lines.append(f"| {r['check']} | {mark} | {r['seconds']:.1f} | {r['detail']} |")
        lines.append(f"\n{'PASSED' if self.passed else 'FAILED'} in {report['elapsed_s']} s")
        table = "\n".join(lines)
        (self.out / "gpu_check.md").write_text(table + "\n")
        print("\n" + table)


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log``; (exit code, seconds); 124 on a timeout."""
    started = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            done = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 1), env=env
            )
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - started


def tail(log: Path, n: int = 3) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return " / ".join(lines[-n:])[-400:]


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


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


def quiet_steps(args: argparse.Namespace) -> list[int]:
    """Steps that neither log, evaluate nor save, after the compile warm-up."""

    def busy(s: int) -> bool:
        return s % args.log_every == 0 or s % args.every == 0 or s == args.steps

    return [s for s in range(WARMUP_STEPS + 1, args.steps) if not busy(s)]


def check_train(args: argparse.Namespace, checks: Checks, run_dir: Path) -> bool:
    syncs = checks.out / "syncs.json"
    entry = [str(Path(__file__).resolve()), RANK_ENTRY, str(syncs), "train"]
    cmd = torchrun(args, [*entry, "--run-dir", str(run_dir), "--quiet", *train_overrides(args)])
    log = checks.out / "train.log"
    rc, seconds = run(cmd, log, checks.left())
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    ok = rc == 0 and rows and rows[-1]["step"] == args.steps
    detail = f"exit {rc}, {len(rows)} loss rows to step {rows[-1]['step'] if rows else '-'}"
    name = "train (torchrun, bf16, compile, lowrank ckpt, async ckpt)"
    if not checks.add(name, bool(ok), detail if ok else f"{detail}: {tail(log)}", seconds):
        return False
    check_syncs(args, checks, syncs)
    first = rows[0]
    build_s = first.get("build_s")
    checks.facts["first_row"] = first
    checks.add(
        "start-up (build_s in the first metrics row)",
        isinstance(build_s, float | int),
        f"build {build_s} s per rank {first.get('build_s_ranks')}",
    )
    last = rows[-1]
    mfu = last.get("mfu")
    checks.facts["speed"] = {"tokens_per_s": last["tokens_per_s"], "mfu": mfu}
    mfu_text = f", MFU {mfu:.1%}" if mfu is not None else " (no peak FLOP/s for this device)"
    checks.add(
        "speed",
        last["tokens_per_s"] > 0 and (mfu is None or 0 < mfu < 1),
        f"{last['tokens_per_s']:,.0f} tokens/s{mfu_text}, loss {rows[0]['loss']:.3f} -> "
        f"{last['loss']:.3f}",
    )
    check_memory(args, checks, run_dir)
    return True


def check_syncs(args: argparse.Namespace, checks: Checks, syncs: Path) -> None:
    if not syncs.exists():
        checks.add("no host sync on quiet steps", False, f"{syncs} was not written")
        return
    per_step = json.loads(syncs.read_text())
    quiet = quiet_steps(args)
    main = {s: {k: n for k, n in c.items() if "background" not in k} for s, c in per_step.items()}
    bad = {s: main[str(s)] for s in quiet if main.get(str(s))}
    busy = {int(s): c for s, c in per_step.items() if int(s) > 0 and int(s) not in quiet}
    what = "sync-debug warnings and conversions" if args.device == "cuda" else "conversions"
    detail = f"{len(quiet)} quiet steps, {what}: " + (f"{bad}" if bad else "none")
    if not quiet:
        checks.add("no host sync on quiet steps", None, "no quiet step: raise --steps")
    elif not busy:
        checks.add("no host sync on quiet steps", False, "nothing counted at all: not wired")
    else:
        checks.add("no host sync on quiet steps", not bad, detail)


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


def check_resume(args: argparse.Namespace, checks: Checks, run_dir: Path, cut: Path) -> None:
    """Continue a copy cut back to the middle checkpoint: the same losses, bit for bit."""
    ckpts = sorted(
        int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
    )
    middle = [s for s in ckpts if 0 < s < args.steps]
    if not middle:
        checks.add("resume bit for bit", False, f"no middle checkpoint among {ckpts}")
        return
    mid = min(middle, key=lambda s: abs(s - args.steps / 2))
    shutil.copytree(run_dir, cut)
    for p in (cut / "checkpoints").glob("step_*"):
        if int(p.name.removeprefix("step_")) > mid:
            shutil.rmtree(p)
    entry = ["-m", "boostlr.cli", "train", "--run-dir", str(cut), "--resume", "--quiet"]
    log = checks.out / "resume.log"
    rc, seconds = run(torchrun(args, entry), log, checks.left())

    def after(rows: list[dict]) -> dict[tuple[int, str], float]:
        keys = ("loss", "val_loss", "grad_norm")
        return {(r["step"], k): r[k] for r in rows if r["step"] > mid for k in keys if k in r}

    want, got = after(read_rows(run_dir)), after(read_rows(cut))
    # The continued run also logs its first step; every value both logged must be equal.
    differ = sorted(k for k in want if got.get(k) != want[k])
    ok = rc == 0 and bool(want) and not differ
    detail = f"exit {rc}, from step {mid}: {len(want)} values compared"
    if differ:
        detail += f"; differ at {differ[:4]}: {[(want[k], got.get(k)) for k in differ[:2]]}"
    elif rc != 0:
        detail += f": {tail(log)}"
    checks.facts["resume"] = {"from_step": mid, "compared": len(want), "differ": len(differ)}
    checks.add("resume bit for bit (torchrun --resume)", ok, detail, seconds)


def boostlr(*argv: str) -> list[str]:
    return [sys.executable, "-m", "boostlr.cli", *argv]


def check_export_eval(args: argparse.Namespace, checks: Checks, run_dir: Path) -> None:
    export = checks.out / "export"
    log = checks.out / "export.log"
    rc, seconds = run(boostlr("export", str(run_dir), "--out", str(export)), log, checks.left())
    files = sorted(p.name for p in export.glob("*")) if export.exists() else []
    ok = rc == 0 and "model.safetensors" in files and "config.json" in files
    checks.add("export", ok, f"exit {rc}, {len(files)} files" if ok else tail(log), seconds)
    if not ok:
        return
    device = ["--parallel.device", args.device]
    if args.data:  # an export does not know its run's dataset
        device += ["--data.path", args.data]
    limit = ["--max-tokens", str(args.eval_tokens), "--json"]
    results = {}
    for label, path in (("export", export), ("checkpoint", run_dir)):
        log = checks.out / f"eval_{label}.log"
        rc, seconds = run(boostlr("eval", str(path), *limit, *device), log, checks.left())
        lines = [x for x in log.read_text().splitlines() if x.startswith("{")]
        result = json.loads(lines[-1]) if rc == 0 and lines else None
        results[label] = result
        detail = (
            f"loss {result['loss']:.4f}, {result['bits_per_byte']:.3f} bits/byte over "
            f"{result['tokens']} tokens"
            if result
            else f"exit {rc}: {tail(log)}"
        )
        checks.add(f"eval of the {label}", result is not None, detail, seconds)
    if all(results.values()):
        a, b = results["export"]["loss"], results["checkpoint"]["loss"]
        checks.add(
            "export's loss = checkpoint's", abs(a - b) <= 2e-3 * abs(b), f"{a:.5f} vs {b:.5f}"
        )
    checks.facts["eval"] = results


def check_suite(args: argparse.Namespace, checks: Checks) -> None:
    if args.device != "cuda":
        checks.add("gpu_suite rows", None, "CUDA only (tests/test_gpu_suite.py dry-runs it)")
        return
    budget = int(min(args.suite_budget_s, checks.left() - 30))
    if budget < 30:
        checks.add("gpu_suite rows", None, f"skipped (budget): {budget} s left")
        return
    out = checks.out / "suite"
    script = ROOT / "benchmarks" / "gpu_suite.py"
    cmd = [sys.executable, str(script), "--out", str(out), "--budget-s", str(budget)]
    log = checks.out / "suite.log"
    rc, seconds = run(cmd, log, budget + 120)
    report_path = out / "gpu_suite.json"
    if rc != 0 or not report_path.exists():
        checks.add("gpu_suite rows", False, f"exit {rc}: {tail(log)}", seconds)
        return
    report = json.loads(report_path.read_text())
    gemm, train = report["gemm"], report["train"]
    detail = (
        f"{len(gemm['rows'])} GEMM rows, {len(train['rows'])} training rows "
        f"({len(gemm['skipped']) + len(train['skipped'])} skipped for the budget), see "
        f"{out / 'gpu_suite.md'}"
    )
    checks.add("gpu_suite rows", bool(gemm["rows"] or train["rows"]), detail, seconds)


NCCL_TESTS = ("tests/test_init.py::test_every_layouts_shards_are_the_one_device_init_bit_for_bit",)


def check_nccl(args: argparse.Namespace, checks: Checks) -> None:
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if gpus < 2:
        checks.add("distributed tests on NCCL", None, f"needs 2 or more GPUs, {gpus} visible")
        return
    if checks.left() < 60:
        checks.add("distributed tests on NCCL", None, "skipped (budget)")
        return
    env = {**os.environ, "BOOSTLR_TEST_BACKEND": "nccl"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", *NCCL_TESTS]
    log = checks.out / "nccl_tests.log"
    rc, seconds = run(cmd, log, checks.left(), env={**env, "PWD": str(ROOT)})
    checks.add("distributed tests on NCCL", rc == 0, f"exit {rc}: {tail(log, 1)}", seconds)


def check_init_devices(args: argparse.Namespace, checks: Checks) -> None:
    """The counter-based init draws the same bits on the GPU as on the CPU."""
    name = "init: GPU draws = CPU draws, bit for bit"
    if args.device != "cuda":
        checks.add(name, None, "CUDA only")
        return
    import torch

    from boostlr.models.philox import normal_box, stream_key

    started = time.monotonic()
    cases = [((4096, 1024), None), ((32000, 4096), [(8000, 16000), (1024, 2048)])]
    cases += [((11008, 1024), [(0, 11008), (2752, 5504)]), ((101, 37), [(3, 99), (5, 31)])]
    differ = []
    for shape, box in cases:
        key = stream_key("gpu_check", shape)
        on_gpu = normal_box(key, shape, box, device="cuda").cpu()
        if not torch.equal(on_gpu, normal_box(key, shape, box)):
            differ.append(shape)
    detail = f"{len(cases)} boxes" + (f"; differ: {differ}" if differ else ", all equal")
    checks.add(name, not differ, detail, time.monotonic() - started)


def check_data(args: argparse.Namespace, checks: Checks) -> bool:
    if args.data:
        ok = (Path(args.data) / "manifest.json").exists()
        return checks.add("data", ok, f"{args.data}" + ("" if ok else ": no manifest.json"))
    started = time.monotonic()
    from boostlr.data.prepare import default_dataset

    path = default_dataset(progress=False)
    return checks.add("data (default corpus)", True, str(path), time.monotonic() - started)


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
    ap.add_argument("--budget-s", type=float, default=470, help="wall-clock budget, seconds")
    ap.add_argument("--suite-budget-s", type=float, default=150)
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
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [RANK_ENTRY]:
        return rank_train(Path(argv[1]), argv[2:])
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
    print(checks.facts["machine"], flush=True)
    try:
        run_dir = out / "run"
        check_init_devices(args, checks)
        if check_data(args, checks) and check_train(args, checks, run_dir):
            check_resume(args, checks, run_dir, out / "resumed")
            check_export_eval(args, checks, out / "resumed")
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
