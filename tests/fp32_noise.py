"""How close a parallel layout's fp32 gradients must be to the single-device ones.

A fixed tolerance (``max |g - g_ref| / max |g_ref| < 2e-5``) held on one CPU and failed on
another (an AMD EPYC: 2.5e-5 for LaX under pp2 x tp2), because the CPU's kernels set the
size of fp32 rounding noise. So the noise is measured on the CPU at hand: the single-device
model's own fp32 gradients against the same model in float64 (the exact values both fp32
paths approximate). A layout sums in another order and draws noise of the same size, so its
error against float64 may be ``NOISE_FACTOR`` times the single device's, and the difference
of the two fp32 results ``NOISE_FACTOR + 1`` times. A real bug (a missing all-reduce, a
wrong slice) is off by O(1), five orders of magnitude above either bound.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

NOISE_FACTOR = 4.0
# bf16: a layout's error against float64 over the one-device bf16 run's own.
BF16_FACTOR = 4.0
# A single-device error that happens to be tiny (every tensor exact by luck) must not make
# the bound tighter than a few fp32 ulps of the largest gradient element.
NOISE_FLOOR = 1e-6


def relative_error(g: torch.Tensor, exact: torch.Tensor) -> float:
    """``max |g - exact| / max |exact|`` in float64."""
    exact = exact.double()
    return ((g.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-12)).item()


def float64_grads(model: torch.nn.Module, inputs, targets) -> dict[str, torch.Tensor]:
    """Gradients of a float64 copy of ``model`` (a single-device ``LlamaModel``) on a batch."""
    exact = copy.deepcopy(model).double()
    exact.zero_grad(set_to_none=True)
    exact(inputs, targets).backward()
    return {n: p.grad for n, p in exact.named_parameters()}


def noise_of(grads: Iterable[tuple[str, torch.Tensor]], exact: dict[str, torch.Tensor]) -> float:
    """The worst tensor's :func:`relative_error` against the float64 gradients."""
    return max(relative_error(g, exact[n]) for n, g in grads)


def layout_bound(single_noise: float) -> float:
    """Allowed error of a layout's gradients against float64."""
    return NOISE_FACTOR * max(single_noise, NOISE_FLOOR)


def bf16_layout_bound(single_bf16_noise: float) -> float:
    """Allowed error against float64 of a layout's bf16-autocast gradients.

    The yardstick is the one-device bf16 run's own error against float64 on the same batch:
    bf16 rounding differs by CPU (its kernels accumulate in different orders and widths), so a
    hand-set bound that held on one CPU failed on another. Two roundings of the same
    quantities in another order differ by about the size of either; the factor leaves room
    for a layout rounding a few more partial sums (BTP's partials before their all-reduce),
    while a layout that keeps the residual or a statistic in bf16 shows as a multiple of it.
    """
    return BF16_FACTOR * single_bf16_noise


def difference_bound(single_noise: float) -> float:
    """Allowed ``max |g - g_ref| / max |g_ref|`` between a layout's and one device's fp32."""
    return (NOISE_FACTOR + 1) * max(single_noise, NOISE_FLOOR)
