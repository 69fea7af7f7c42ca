"""The gradient bound of the parallel tests is measured fp32 noise, and it stays tight."""

from __future__ import annotations

import torch
from fp32_noise import difference_bound, float64_grads, layout_bound, noise_of, relative_error

from boostlr.config import build_config
from boostlr.models.llama import build_model


def test_measured_noise_is_rounding_sized_and_rejects_a_small_real_error() -> None:
    """A tiny LaX model's fp32 gradients sit within ~1e-7..1e-4 of float64 (rounding, not
    zero, not a bug), and a gradient 0.1% off (far below any real sharding bug) is outside
    both bounds built from that noise."""
    cfg = build_config(overrides=[("model.preset", "tiny"), ("model.arch", "lax")]).model
    cfg.vocab_size = 101
    model = build_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model(inputs, targets).backward()
    exact = float64_grads(model, inputs, targets)
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    noise = noise_of(grads, exact)
    assert 1e-8 < noise < 1e-4, noise
    name, g = max(grads, key=lambda item: item[1].abs().max().item())
    off = g * (1 + 1e-3)
    assert relative_error(off, exact[name]) > layout_bound(noise)
    assert relative_error(off, g) > difference_bound(noise)
