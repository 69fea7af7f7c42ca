"""What the vLLM tests share: exports vLLM's CPU attention takes, a vLLM run in its own
process, and the references a served export is held to (``boostlr generate``, transformers'
remote code, float64)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from export_cases import perturbed_model, run_config, write_checkpoint
from fp32_noise import relative_error

from boostlr.export import export_checkpoint, load_pretrained
from boostlr.generate import generate

CASE_SCRIPT = Path(__file__).with_name("vllm_case.py")
# vLLM's CPU attention takes head sizes 32, 64, 80, ...: the tiny preset (d 64) with 2 heads.
HEAD32 = [("model.n_heads", "2"), ("model.n_kv_heads", "1")]
MOE = [("model.moe_experts", "4"), ("model.moe_top_k", "2"), ("model.moe_ffn_dim", "32")]
DENSE_FIRST = [("model.n_layers", "3"), ("model.moe_dense_layers", "1")]
PROMPTS = ["alpha beta gamma delta", "kappa", "omicron pi alpha beta gamma delta epsilon zeta"]
NEW_TOKENS = 8


def export_case(root: Path, arch: str, overrides: list, tokenizer_file: Path) -> Path:
    """A perturbed tiny model of ``arch`` exported with ``boostlr export``; an MoE model's
    balance bias is moved off zero, so an export that dropped it would route differently."""
    cfg = run_config(arch, *overrides)
    model = perturbed_model(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
    ckpt = write_checkpoint(root / "run", cfg, model, tokenizer_file)
    return export_checkpoint(ckpt, root / "export")


def serve(export: Path, out: Path, dtype: str = "float32", tp: int = 1) -> list[dict]:
    """vLLM's greedy generation of :data:`PROMPTS` (one batch), run in a process of its own."""
    cmd = [sys.executable, str(CASE_SCRIPT), str(export), str(out), "--dtype", dtype]
    cmd += ["--tp", str(tp), "--max-tokens", str(NEW_TOKENS), "--eager"]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in-process
    if tp > 1:
        # vLLM's CPU workers bind to a NUMA node each by default; one node here: a core each.
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(tp))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())["results"]


def boostlr_texts(export: Path) -> list[str]:
    """``boostlr generate --temperature 0`` of each prompt on the export, whole text."""
    model, tokenizer = load_pretrained(export)
    return [
        generate(model, tokenizer, p, max_new_tokens=NEW_TOKENS, temperature=0) for p in PROMPTS
    ]


def served_texts(export: Path, results: list[dict]) -> list[str]:
    """Prompt and vLLM's tokens, decoded as ``boostlr generate`` decodes its own."""
    _, tokenizer = load_pretrained(export)
    return [tokenizer.decode(r["prompt_token_ids"] + r["token_ids"]) for r in results]


def logprob_errors(export: Path, results: list[dict], dtype: torch.dtype) -> tuple[float, float]:
    """vLLM's top log-probabilities against transformers' on the same export (the remote code,
    or LLaMA for a dense export) in ``dtype``, both measured against float64 on the served
    sequences: ``(vllm's error, transformers' error)``, each ``max |lp - exact| / max |exact|``
    over every step and listed token."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        export, trust_remote_code=True, dtype=dtype
    ).eval()
    ours, _ = load_pretrained(export)
    exact_model = copy.deepcopy(ours).double()
    served, theirs, exact = [], [], []
    for r in results:
        ids = torch.tensor([r["prompt_token_ids"] + r["token_ids"]])
        n = len(r["prompt_token_ids"])
        with torch.no_grad():
            hf_lp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
            exact_lp = torch.log_softmax(exact_model(ids)[0], -1)
        for step, top in enumerate(r["logprobs"]):
            pos = n - 1 + step  # the logits that chose generated token ``step``
            for token, lp in top.items():
                served.append(lp)
                theirs.append(hf_lp[pos, int(token)].item())
                exact.append(exact_lp[pos, int(token)].item())
    exact_t = torch.tensor(exact, dtype=torch.float64)
    return (
        relative_error(torch.tensor(served, dtype=torch.float64), exact_t),
        relative_error(torch.tensor(theirs, dtype=torch.float64), exact_t),
    )
