"""Serve one export in vLLM (offline ``LLM``) and write what it generated, as JSON.

Run as its own process by the vLLM tests (``python tests/serve_vllm/vllm_case.py EXPORT OUT.json
--dtype float32 --tp 1 --prompt ... --max-tokens N``), so that every engine starts in a
fresh process, as a user's would. For each prompt it records the prompt's token ids, the
greedy tokens and, per generated token, the ``--logprobs`` most likely tokens' log
probabilities (vLLM's raw ones, from the model's logits). It imports vLLM and nothing of
boostlr: the export is served from its own files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def serve(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        str(args.export),
        trust_remote_code=True,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs)
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    results = []
    for out in outputs:
        gen = out.outputs[0]
        steps = [{str(t): lp.logprob for t, lp in step.items()} for step in gen.logprobs]
        results.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(gen.token_ids),
                "text": gen.text,
                "logprobs": steps,
            }
        )
    return {"results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("export", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--eager", action="store_true", help="no torch.compile (enforce_eager)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tests' models are tiny
    args.out.write_text(json.dumps(serve(args)))
    # The results are written; vLLM's teardown at interpreter exit (engine and worker
    # shutdown after a grace period) is not what is tested, and on a loaded machine it has
    # failed after a good run. Leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
