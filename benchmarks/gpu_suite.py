"""One command for a lent GPU machine: GEMM utilisation, one-GPU training steps, TP over NCCL.

Writes ``gpu_suite.json`` and ``gpu_suite.md`` into ``--out`` (default ``benchmarks/out``):

1. GEMM TFLOP/s and arithmetic intensity of the per-rank linear GEMMs (forward, input-grad
   and weight-grad shapes from ``boostlr.analysis.gemms``) of vanilla TP vs BTP, CoLA at the
   1B-30B presets, T = 4 and 8: BTP's reduction dims (d/t, r) stay large where vanilla's B
   has r/t, the paper's utilisation claim.
2. One-GPU training steps (the trainer's model and step, ``benchmarks/common.py``: bf16
   autocast, clipping, fused AdamW): tokens/s, MFU and peak memory for
   ``full`` vs ``cola`` at 350M and 1B, eager and ``torch.compile``d.
3. With two or more GPUs, ``benchmarks/tp_strategies.py`` over NCCL.

Sections share a time budget (``--budget-s``, default 280 s, so the whole run stays under five
minutes); what does not fit is reported as skipped, never silently dropped. Without a GPU,
``--device cpu --tiny`` runs the same code on tiny shapes in seconds (CI's dry run).

    python benchmarks/gpu_suite.py                       # on a GPU machine
    python benchmarks/gpu_suite.py --device cpu --tiny   # dry run anywhere
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import Part, random_batch, run_config

from boostlr.analysis.gemms import Gemm, backward, block_gemms
from boostlr.config import ModelConfig, build_config
from boostlr.models.counting import flops_per_token
from boostlr.train.perf import peak_flops

GEMM_PRESETS = ("1B", "3B", "7B", "13B", "30B")
TRAIN_PRESETS = ("350M", "1B")
TINY_PRESETS = ("tiny", "small")


@dataclass
class Suite:
    """Settings of one run and the wall-clock budget its sections share."""

    device: torch.device
    tiny: bool
    budget_s: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def model_config(preset: str, arch: str, vocab: int) -> ModelConfig:
    cfg = build_config(overrides=[("model.preset", preset), ("model.arch", arch)]).model
    cfg.vocab_size = vocab
    return cfg


# ----------------------------------------------------------------------------- 1. GEMMs


def linear_gemms(cfg: ModelConfig, strategy: str, tp: int, tokens: int) -> list[Gemm]:
    """Distinct weight GEMMs of one block on one rank: forward, dgrad and wgrad shapes."""
    forward = [g for g in block_gemms(cfg, strategy, tp, 1, tokens) if g.kind == "linear"]
    return [x for g in forward for x in (g, *backward(g))]


def time_gemm(suite: Suite, m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    """Median seconds of ``[m, k] @ [k, n]`` (CUDA events on a GPU)."""
    a = torch.randn(m, k, device=suite.device, dtype=dtype)
    b = torch.randn(k, n, device=suite.device, dtype=dtype)
    a @ b  # warm-up (cuBLAS heuristics, allocator)
    times = []
    for _ in range(reps):
        if suite.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_section(suite: Suite, presets: tuple[str, ...], tps: tuple[int, ...], tokens: int):
    """Per (preset, T, strategy): every GEMM's TFLOP/s and intensity, and the block's total."""
    dtype, elem = torch.bfloat16, 2
    reps = 3 if suite.tiny else 10
    measured: dict[tuple[int, int, int], float] = {}
    rows, skipped = [], []
    for preset in presets:
        cfg = model_config(preset, "cola", 32000)
        for tp in tps:
            for strategy in ("vanilla", "btp"):
                if suite.left() <= 0:
                    skipped.append(f"{preset} T={tp} {strategy}")
                    continue
                gemms = []
                for g in linear_gemms(cfg, strategy, tp, tokens):
                    shape = (g.m, g.k, g.n)
                    if shape not in measured:
                        measured[shape] = time_gemm(suite, *shape, dtype, reps)
                    seconds = measured[shape] * g.count
                    gemms.append(
                        {
                            "name": g.name,
                            "m": g.m,
                            "k": g.k,
                            "n": g.n,
                            "count": g.count,
                            "intensity": g.intensity(elem),
                            "tflops": g.flops / seconds / 1e12,
                            "seconds": seconds,
                        }
                    )
                flops = sum(2.0 * x["m"] * x["k"] * x["n"] * x["count"] for x in gemms)
                seconds = sum(x["seconds"] for x in gemms)
                worst = min(gemms, key=lambda x: x["intensity"])
                rows.append(
                    {
                        "preset": preset,
                        "tp": tp,
                        "strategy": strategy,
                        "tokens": tokens,
                        "block_linear_tflops": flops / seconds / 1e12,
                        "block_linear_seconds": seconds,
                        "mean_intensity": flops / sum(_bytes(x, elem) for x in gemms),
                        "min_intensity": worst["intensity"],
                        "min_intensity_gemm": f"{worst['name']} {worst['m']}x{worst['k']}x"
                        f"{worst['n']}",
                        "min_intensity_tflops": worst["tflops"],
                        "gemms": gemms,
                    }
                )
    return {"dtype": "bfloat16", "rows": rows, "skipped": skipped}


def _bytes(g: dict, elem: int) -> float:
    return (g["m"] * g["k"] + g["k"] * g["n"] + g["m"] * g["n"]) * g["count"] * elem


# ----------------------------------------------------------------------------- 2. training


def train_step_row(
    suite: Suite, preset: str, arch: str, compile: bool, batch: int, seq: int, steps: int
) -> dict:
    """Tokens/s, MFU and peak memory of the one-device training step (bf16 autocast)."""
    vocab = 512 if suite.tiny else 32000
    run = run_config(
        {
            "model.preset": preset,
            "model.arch": arch,
            "model.vocab_size": vocab,
            "data.seq_len": seq,
            "train.batch_size": batch,
            "train.dtype": "bfloat16",
            "train.compile": compile,
            "parallel.device": suite.device.type,
        }
    )
    cfg = run.model
    part = Part.build(run, suite.device)
    inputs, targets = random_batch(vocab, batch, seq, suite.device)
    if suite.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(suite.device)

    def step() -> float:
        return float(part.step(inputs, targets)[1])

    started = time.perf_counter()
    for _ in range(2):  # warm-up: compilation, allocator, cuBLAS heuristics
        step()
    suite.sync()
    warmup_s = time.perf_counter() - started
    times, loss = [], float("nan")
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        suite.sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tok = batch * seq
    flops_per_s = flops_per_token(cfg, seq) * tok / step_s
    peak = peak_flops(suite.device, "bfloat16")
    row = {
        "preset": preset,
        "arch": arch,
        "mode": "compiled" if compile else "eager",
        "batch": batch,
        "seq": seq,
        "step_s": step_s,
        "warmup_s": warmup_s,
        "tokens_per_s": tok / step_s,
        "tflops": flops_per_s / 1e12,
        "mfu": flops_per_s / peak if peak else None,
        "peak_mem_mb": (
            torch.cuda.max_memory_allocated(suite.device) / 2**20
            if suite.device.type == "cuda"
            else None
        ),
        "loss": loss,
    }
    return row


def train_section(suite: Suite, args: argparse.Namespace) -> dict:
    presets = TINY_PRESETS if suite.tiny else TRAIN_PRESETS
    modes = (False,) if args.no_compile else (False, True)
    rows, skipped = [], []
    for preset in presets:
        for arch in ("full", "cola"):
            for compile in modes:
                label = f"{preset} {arch} {'compiled' if compile else 'eager'}"
                if suite.left() <= 0:
                    skipped.append(label)
                    continue
                try:
                    rows.append(
                        train_step_row(
                            suite, preset, arch, compile, args.batch_size, args.seq_len, args.steps
                        )
                    )
                except torch.OutOfMemoryError:
                    skipped.append(f"{label}: out of memory at batch {args.batch_size}")
                if suite.device.type == "cuda":  # the model and optimizer of the row are gone
                    torch.cuda.empty_cache()
    notes = [] if modes == (False, True) else ["compiled rows skipped (--no-compile)"]
    return {"dtype": "bfloat16", "rows": rows, "skipped": skipped, "notes": notes}


# ----------------------------------------------------------------------------- 3. TP/NCCL


def tp_section(suite: Suite, args: argparse.Namespace) -> dict:
    gpus = torch.cuda.device_count() if suite.device.type == "cuda" else 0
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible: needs 2 or more"}
    tps = [t for t in (2, 4, 8) if t <= gpus]
    script = Path(__file__).with_name("tp_strategies.py")
    cmd = [sys.executable, str(script), "--device", "cuda", "--tp", *map(str, tps)]
    cmd += ["--preset", args.tp_preset, "--seq-len", "2048", "--vocab", "32000"]
    timeout = max(suite.left(), 0.0)
    if timeout < 30:
        return {"skipped": f"{timeout:.0f} s of the budget left", "command": " ".join(cmd)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        error = f"timed out after {timeout:.0f} s"
        return {"command": " ".join(cmd), "error": error, "output": out}
    result = {"command": " ".join(cmd), "returncode": done.returncode, "output": done.stdout}
    if done.returncode:
        result["error"] = done.stderr[-2000:]
    return result


# ----------------------------------------------------------------------------- report


def environment(suite: Suite) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": str(suite.device),
        "tiny": suite.tiny,
    }
    if suite.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(suite.device)
        env["gpus"] = torch.cuda.device_count()
    env["peak_bf16_tflops"] = (peak_flops(suite.device, "bfloat16") or 0) / 1e12 or None
    return env


def markdown(report: dict) -> str:
    env, gemm, train, tp = report["environment"], report["gemm"], report["train"], report["tp"]
    lines = [
        "# gpu_suite",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
        f"## GEMMs of one block per rank (CoLA, {gemm['dtype']}, {gemm['tokens']} tokens)",
        "",
        "| preset | T | strategy | block TFLOP/s | mean intensity | min intensity (GEMM) | "
        "its TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in gemm["rows"]:
        lines.append(
            f"| {r['preset']} | {r['tp']} | {r['strategy']} | {r['block_linear_tflops']:.3g} | "
            f"{r['mean_intensity']:.0f} | {r['min_intensity']:.0f} ({r['min_intensity_gemm']}) "
            f"| {r['min_intensity_tflops']:.3g} |"
        )
    lines += _skipped(gemm["skipped"])
    lines += [
        "",
        f"## One-device training step ({train['dtype']} autocast)",
        "",
        "| preset | arch | mode | batch x seq | tokens/s | TFLOP/s | MFU | peak MB | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_mem_mb']:,.0f}" if r["peak_mem_mb"] is not None else "n/a"
        lines.append(
            f"| {r['preset']} | {r['arch']} | {r['mode']} | {r['batch']} x {r['seq']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {mfu} | {mem} | "
            f"{r['warmup_s']:.1f} |"
        )
    lines += _skipped(train["skipped"]) + [f"- {n}" for n in train["notes"]]
    lines += ["", "## Tensor-parallel strategies over NCCL", ""]
    if "output" in tp:
        lines += [f"`{tp['command']}`", "", "```", tp["output"].rstrip(), "```"]
    if "error" in tp or "skipped" in tp:
        lines.append(f"- {tp.get('error') or tp.get('skipped')}")
    return "\n".join(lines) + "\n"


def _skipped(items: list[str]) -> list[str]:
    return [f"- skipped (budget): {', '.join(items)}"] if items else []


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_suite: --device cuda but no GPU is visible (use --device cpu --tiny)")
    suite = Suite(device, args.tiny, args.budget_s)
    presets = TINY_PRESETS if args.tiny else GEMM_PRESETS
    tps = (2, 4) if args.tiny else (4, 8)
    tokens = 256 if args.tiny else args.gemm_tokens
    report = {"environment": environment(suite), "gemm": gemm_section(suite, presets, tps, tokens)}
    report["gemm"]["tokens"] = tokens
    report["train"] = train_section(suite, args)
    report["tp"] = tp_section(suite, args)
    report["elapsed_s"] = time.monotonic() - suite.started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_suite.md").write_text(markdown(report))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run anywhere")
    parser.add_argument("--out", default=str(Path(__file__).with_name("out")))
    parser.add_argument("--budget-s", type=float, default=280.0)
    parser.add_argument("--gemm-tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed training steps")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tp-preset", default="1B")
    args = parser.parse_args(argv)
    # Tiny: small shapes and no compiled rows (inductor's first build alone takes ~30 s on a
    # CPU); the compiled path itself is tested in tests/test_compile.py.
    args.batch_size = args.batch_size or (2 if args.tiny else 8)
    args.seq_len = args.seq_len or (32 if args.tiny else 1024)
    args.steps = args.steps or (2 if args.tiny else 5)
    args.no_compile = args.no_compile or args.tiny
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print(markdown(report))
    print(f"# wrote {Path(args.out) / 'gpu_suite.json'} and gpu_suite.md", file=sys.stderr)


if __name__ == "__main__":
    main()
