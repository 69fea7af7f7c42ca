"""The checks of ``benchmarks/gpu_check.py`` beside the training run: the GPU's init draws,
the data, the collectives of a 3-D layout, export and eval, the GPU suite, NCCL tests."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_check_run import CAPS, ROOT, Checks, step_env, tail


def check_collectives(args: argparse.Namespace, checks: Checks) -> None:
    """Each rank of pp2 x dp2 x tp2 traced on this device's tensors; calls paired across ranks."""
    name = "collectives of pp2 x dp2 x tp2 agree across ranks (fake world)"
    out = checks.out / "collectives"
    script = ROOT / "benchmarks" / "gpu_collectives.py"
    cmd = [sys.executable, str(script), "--device", args.device, "--out", str(out)]
    log = checks.out / "collectives.log"
    step = checks.step(cmd, log, CAPS["collectives"], step_env(args.deterministic))
    if step.rc == 124:
        checks.timed_out(name, step, log)
        return
    path = out / "collectives.json"
    if not path.exists():
        checks.add(name, False, f"exit {step.rc}: {tail(log)}", step.seconds)
        return
    report = json.loads(path.read_text())
    calls, problems = report["calls"], report["problems"]
    notes = report.get("notes", [])
    checks.facts["collectives"] = {"calls": calls, "problems": problems[:20], "notes": notes[:20]}
    detail = f"{sum(calls.values())} collectives on {len(calls)} ranks ({args.device} tensors), "
    detail += f"{len(problems)} mismatches" + (f": {problems[:2]}" if problems else "")
    if notes:
        detail += f"; {len(notes)} shape-only differences at equal counts (notes)"
    checks.add(name, step.rc == 0 and not problems and bool(calls), detail, step.seconds)


def boostlr(*argv: str) -> list[str]:
    return [sys.executable, "-m", "boostlr.cli", *argv]


def check_export_eval(args: argparse.Namespace, checks: Checks, run_dir: Path) -> None:
    export = checks.out / "export"
    log = checks.out / "export.log"
    cmd = boostlr("export", str(run_dir), "--out", str(export))
    step = checks.step(cmd, log, CAPS["export"])
    if step.rc == 124:
        checks.timed_out("export", step, log)
        return
    files = sorted(p.name for p in export.glob("*")) if export.exists() else []
    ok = step.rc == 0 and "model.safetensors" in files and "config.json" in files
    detail = f"exit {step.rc}, {len(files)} files" if ok else tail(log)
    checks.add("export", ok, detail, step.seconds)
    if not ok:
        return
    device = ["--parallel.device", args.device]
    if args.data:  # an export does not know its run's dataset
        device += ["--data.path", args.data]
    limit = ["--max-tokens", str(args.eval_tokens), "--json"]
    results = {}
    for label, path in (("export", export), ("checkpoint", run_dir)):
        name = f"eval of the {label}"
        log = checks.out / f"eval_{label}.log"
        step = checks.step(boostlr("eval", str(path), *limit, *device), log, CAPS["eval"])
        if step.rc == 124:
            checks.timed_out(name, step, log)
            return
        lines = [x for x in log.read_text().splitlines() if x.startswith("{")]
        result = json.loads(lines[-1]) if step.rc == 0 and lines else None
        results[label] = result
        detail = (
            f"loss {result['loss']:.4f}, {result['bits_per_byte']:.3f} bits/byte over "
            f"{result['tokens']} tokens"
            if result
            else f"exit {step.rc}: {tail(log)}"
        )
        checks.add(name, result is not None, detail, step.seconds)
    if all(results.values()):
        a, b = results["export"]["loss"], results["checkpoint"]["loss"]
        checks.add(
            "export's loss = checkpoint's", abs(a - b) <= 2e-3 * abs(b), f"{a:.5f} vs {b:.5f}"
        )
    checks.facts["eval"] = results


def check_suite(args: argparse.Namespace, checks: Checks) -> None:
    name = "gpu_suite rows"
    if args.device != "cuda":
        checks.add(name, None, "CUDA only (tests/test_gpu_suite.py dry-runs it)")
        return
    budget = int(min(args.suite_budget_s, checks.left() - 30))
    if budget < 30:
        checks.skip_budget(name)
        return
    out = checks.out / "suite"
    script = ROOT / "benchmarks" / "gpu_suite.py"
    cmd = [sys.executable, str(script), "--out", str(out), "--budget-s", str(budget)]
    log = checks.out / "suite.log"
    # The suite stops its own sections at its budget; a section started late may run past.
    step = checks.step(cmd, log, budget + 60)
    if step.rc == 124:
        checks.timed_out(name, step, log)
        return
    report_path = out / "gpu_suite.json"
    if step.rc != 0 or not report_path.exists():
        checks.add(name, False, f"exit {step.rc}: {tail(log)}", step.seconds)
        return
    report = json.loads(report_path.read_text())
    gemm, train = report["gemm"], report["train"]
    detail = (
        f"{len(gemm['rows'])} GEMM rows, {len(train['rows'])} training rows "
        f"({len(gemm['skipped']) + len(train['skipped'])} skipped for the budget), see "
        f"{out / 'gpu_suite.md'}"
    )
    checks.add(name, bool(gemm["rows"] or train["rows"]), detail, step.seconds)


NCCL_TESTS = ("tests/test_init.py::test_every_layouts_shards_are_the_one_device_init_bit_for_bit",)


def check_nccl(args: argparse.Namespace, checks: Checks) -> None:
    import torch

    name = "distributed tests on NCCL"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if gpus < 2:
        checks.add(name, None, f"needs 2 or more GPUs, {gpus} visible")
        return
    if checks.left() < 60:
        checks.skip_budget(name)
        return
    env = {**os.environ, "BOOSTLR_TEST_BACKEND": "nccl"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", *NCCL_TESTS]
    log = checks.out / "nccl_tests.log"
    step = checks.step(cmd, log, checks.left(), env=env, cwd=ROOT)
    if step.rc == 124:
        checks.timed_out(name, step, log)
        return
    checks.add(name, step.rc == 0, f"exit {step.rc}: {tail(log, 1)}", step.seconds)


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
