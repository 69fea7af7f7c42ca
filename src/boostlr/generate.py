"""Text sampling from a trained model: a quick qualitative check, not a serving engine.

Each step reruns the full forward on the (truncated) context; there is no KV cache because
the models this is used with are small and the code stays obviously correct. Sampling draws
from a seeded CPU generator on CPU logits, so a seed gives the same text on any device.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from boostlr.data.tokenizer import eos_id
from boostlr.errors import BoostlrError
from boostlr.models.llama import LlamaModel


def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Prompt plus up to ``max_new_tokens`` sampled tokens, decoded.

    ``temperature == 0`` is greedy argmax; ``top_k=None`` samples from the whole vocabulary.
    Generation stops early at the end-of-document token, since what follows it is an
    unrelated document.
    """
    _validate(prompt, max_new_tokens, temperature, top_k)
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise BoostlrError("--prompt encodes to no tokens: pass some text as --prompt")
    eos = eos_id(tokenizer)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], device=device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -model.cfg.max_seq_len :])[0, -1].float().cpu()
            next_id = _pick(logits, temperature, top_k, generator)
            tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
            if next_id == eos:
                break
    return tokenizer.decode(tokens[0].tolist())


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _validate(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if not prompt:
        raise BoostlrError("--prompt is empty: pass some text to continue")
    if max_new_tokens < 1:
        raise BoostlrError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:  # also rejects NaN
        raise BoostlrError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise BoostlrError(f"--top-k must be >= 1, got {top_k}")
