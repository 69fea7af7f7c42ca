"""Serving a bottleneck model: vLLM offline throughput and latency, full vs CoLA vs LaX, and
CoLA-MoE (latent dispatch) vs dense MoE, at one shape and batch.

Each model is built at random init, written as a checkpoint and exported with
``boostlr export`` (the path a trained run takes), then served by vLLM in a process of its own
(``--serve-one``: a dense model on vLLM's LLaMA code, the others on its Transformers backend
through the export's remote code). Per model, after one warm-up batch:

- **throughput**: ``--batch`` prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy
  tokens each (``ignore_eos``), as one ``generate`` call: generated tokens per second of wall
  time (prefill included), median of ``--repeats``;
- **latency**: one prompt alone, ``--new-tokens`` tokens: milliseconds per generated token,
  median of ``--repeats``.

Then the ratios to ``full`` (and CoLA-MoE's to dense MoE's), and the issue's goal: CoLA's
throughput at least 1.3x full's. The engines run eagerly (``enforce_eager``: no
torch.compile, whose CPU compile takes minutes per model). One engine runs at a time
(as a server runs); the models take turns over ``--rounds`` rounds, each a fresh engine, and
each figure is the median over the rounds, so load on the machine shifts them alike;
``uptime`` is printed before and after. ``full`` is served twice: on vLLM's own LLaMA code
(what a user gets) and on the Transformers backend (``model_impl="transformers"``), the
backend the bottleneck models run on, which separates the arch from the backend.

    /path/to/vllm-venv/bin/python benchmarks/serve.py            # d 512, 4 blocks, batch 16
    /path/to/vllm-venv/bin/python benchmarks/serve.py --quick    # tiny: a check, not a result
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

# label, arch, extra model overrides
MODELS: list[tuple[str, str, dict[str, str]]] = [
    ("full", "full", {}),
    ("full (Transformers backend)", "full", {}),
    ("cola", "cola", {}),
    ("lax", "lax", {}),
    ("dense MoE", "full", {"model.moe_dispatch": "hidden"}),
    ("CoLA-MoE latent", "cola", {"model.moe_dispatch": "latent"}),
]
FULL = dict(dim=512, layers=4, heads=8, ffn=1376, vocab=4096, experts=8, top_k=2, ffn_e=344)
FULL |= dict(batch=16, prompt_len=32, new_tokens=32, repeats=2)
QUICK = dict(dim=128, layers=2, heads=4, ffn=352, vocab=1024, experts=4, top_k=2, ffn_e=64)
QUICK |= dict(batch=4, prompt_len=8, new_tokens=8, repeats=1)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def write_export(root: Path, label: str, arch: str, extra: dict[str, str], s: dict) -> Path:
    """A random-init model of the shape, checkpointed and exported by boostlr."""
    import torch

    from boostlr.config import build_config, to_dict
    from boostlr.data.tokenizer import train_bpe
    from boostlr.export import export_checkpoint
    from boostlr.models.llama import build_model
    from boostlr.rundir.writer import CheckpointWriter

    overrides = {
        "model.arch": arch,
        "model.dim": s["dim"],
        "model.n_layers": s["layers"],
        "model.n_heads": s["heads"],
        "model.n_kv_heads": s["heads"],
        "model.ffn_dim": s["ffn"],
        "model.vocab_size": s["vocab"],
    }
    if "MoE" in label:
        overrides |= {
            "model.moe_experts": s["experts"],
            "model.moe_top_k": s["top_k"],
            "model.moe_ffn_dim": s["ffn_e"],
        }
    overrides |= extra
    cfg = build_config(overrides=[(k, str(v)) for k, v in overrides.items()])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(stdlib / n).read_text() for n in ("argparse.py", "textwrap.py", "dataclasses.py")]
    tokenizer = root / "tokenizer.json"
    if not tokenizer.exists():
        train_bpe(docs, s["vocab"]).save(str(tokenizer))
    model = build_model(cfg.model, seed=0)
    writer = CheckpointWriter(root / label / "run" / "checkpoints", rank=0, group=None, keep=1)
    writer.save(
        1,
        {"model": model.state_dict()},
        trainer={"step": 1},
        rng={"cpu": torch.get_rng_state()},
        meta={"config": {"model": to_dict(cfg)["model"]}},
        extra_files={"tokenizer.json": tokenizer},
    )
    return export_checkpoint(writer.wait(), root / label / "export")


def serve_one(export: Path, s: dict, model_impl: str) -> dict[str, Any]:
    """Throughput and latency of one export in a vLLM engine (this process)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        str(export),
        trust_remote_code=True,
        model_impl=model_impl,
        dtype="float32",
        max_model_len=s["prompt_len"] + s["new_tokens"] + 8,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = [
        TokensPrompt(
            prompt_token_ids=[(7 * i + 13 * j) % s["vocab"] for j in range(s["prompt_len"])]
        )
        for i in range(s["batch"])
    ]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    throughput, latency = [], []
    for _ in range(s["repeats"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        throughput.append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
        t = time.perf_counter()
        out = llm.generate(prompts[:1], params, use_tqdm=False)
        latency.append((time.perf_counter() - t) * 1e3 / len(out[0].outputs[0].token_ids))
    return {"tok_s": statistics.median(throughput), "ms_tok": statistics.median(latency)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=3, help="times each model is served, in turns (median)"
    )
    parser.add_argument("--serve-one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--model-impl", default="auto", help=argparse.SUPPRESS)
    for key in ("dim", "ffn", "ffn_e", "batch"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {FULL[key]}")
    args = parser.parse_args()
    if args.serve_one:
        print(json.dumps(serve_one(args.serve_one, json.loads(args.shape), args.model_impl)))
        return
    s = dict(QUICK if args.quick else FULL)
    s |= {k: getattr(args, k) for k in ("dim", "ffn", "ffn_e", "batch") if getattr(args, k)}
    print(f"shape: {s}")
    print(f"load before: {uptime()}")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        exports = {
            label: write_export(Path(tmp), label, arch, extra, s) for label, arch, extra in MODELS
        }
        for round_ in range(args.rounds):  # the models take turns: load hits them alike
            for label, _, _ in MODELS:
                impl = "transformers" if "Transformers backend" in label else "auto"
                cmd = [sys.executable, __file__, "--serve-one", str(exports[label])]
                cmd += ["--shape", json.dumps(s), "--model-impl", impl]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{label}: vLLM failed\n{done.stderr[-4000:]}")
                runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"  round {round_ + 1} {label}: {runs[label][-1]}", flush=True)
    rows = {
        label: {key: statistics.median(r[key] for r in results) for key in ("tok_s", "ms_tok")}
        for label, results in runs.items()
    }
    print(f"load after: {uptime()}")
    ref = {label: "full" for label, _, _ in MODELS[:4]}
    ref |= {"dense MoE": "dense MoE", "CoLA-MoE latent": "dense MoE"}
    print("\n| model | generated tok/s | vs ref | ms / token (batch 1) | vs ref |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        base = rows[ref[label]]
        print(
            f"| {label} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x "
            f"({ref[label]}) | {r['ms_tok']:.1f} | {r['ms_tok'] / base['ms_tok']:.2f}x |"
        )
    ratio = rows["cola"]["tok_s"] / rows["full"]["tok_s"]
    verdict = "met" if ratio >= 1.3 else "NOT met"
    print(f"\ngoal CoLA >= 1.3x full's generated tok/s: {ratio:.2f}x, {verdict}")
    same = rows["cola"]["tok_s"] / rows["full (Transformers backend)"]["tok_s"]
    print(f"CoLA / full, both on the Transformers backend (the arch alone): {same:.2f}x")


if __name__ == "__main__":
    main()
