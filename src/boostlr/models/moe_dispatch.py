"""Sending routed token copies to their experts and combining the results, on one device.

The dispatch reads the router's map (:class:`~boostlr.models.moe_routing.Routing`: token,
expert and weight per copy) and computes ``out[t] = Σ_c w[c] · expert_{e[c]}(payload[t])``
over the routed copies ``c`` of each token ``t``. The math is :mod:`boostlr.hf.moe_grouped`
(torch-only, shared with the export's remote code, so it takes the map's tensors, not the
map): :func:`dropless` sorts the copies by expert once and runs the experts on the sorted
rows, each factor one grouped GEMM with device offsets, so at ep 1 nothing is read back to
the host; :func:`with_capacity` gives every expert ``capacity`` rows of one
``[E, capacity, width]`` buffer (fixed shapes, one batched GEMM per factor; the copies past
an expert's capacity, in the map's priority order, are dropped and counted).

What stays here is the runtime's side: which form the experts run on this device
(:func:`grouped_here`, the platform's answer, decided once per device and dtype) and the
counted host reads, :func:`host_counts`: expert parallelism's one copy of the counts per
MoE layer and micro-batch (to size its all-to-all), and the padded fallback's read of the
busiest expert's count where the device has no grouped kernel.

Expert parallelism routes through :class:`Dispatch`, a function of :func:`dropless`'s
signature that the parallel engine gives the layer (:mod:`boostlr.parallel.expert_parallel`):
the model imports nothing from the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from boostlr.hf import moe_grouped
from boostlr.hf.moe_grouped import ExpertFn, expert_counts, grouped_widths_fit
from boostlr.models.moe_routing import Routing
from boostlr.platform import platform_for

__all__ = [
    "Dispatch",
    "ExpertFn",
    "dropless",
    "expert_counts",
    "grouped_here",
    "host_counts",
    "host_max",
    "with_capacity",
]

#: ``(payload, routing, experts, fn) -> (combined, dropped)``: :func:`dropless`'s
#: arguments, and the copies it dropped (0-d int64 on the device).
Dispatch = Callable[[torch.Tensor, Routing, int, ExpertFn], tuple[torch.Tensor, torch.Tensor]]


def host_counts(counts: torch.Tensor) -> list[int]:
    """Per-expert copy counts on the host: the MoE layer's one device-to-host copy where it
    needs one (expert parallelism; the padded fallback).

    Kept in this one function so it is the only place the MoE layer waits for the device
    (tests/test_moe_model.py and tests/test_host_syncs.py count its calls).
    """
    return counts.tolist()


def host_max(counts: torch.Tensor) -> int:
    """The busiest expert's copies (the padded fallback's buffer rows), through
    :func:`host_counts`."""
    return max(host_counts(counts), default=0)


def grouped_here(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...]) -> bool:
    """Whether the experts run grouped on ``device`` computing in ``dtype``: its platform
    has a grouped kernel for the dtype that needs no host read (decided once per device and
    dtype), and the GEMM ``widths`` keep its row alignment. Else the padded fallback runs
    (:func:`boostlr.hf.moe_grouped.run_experts`)."""
    runs = platform_for(device).grouped_mm_runs(device, dtype)
    return runs and grouped_widths_fit(widths, dtype)


def dropless(payload: torch.Tensor, route: Routing, experts: int, fn: ExpertFn) -> torch.Tensor:
    """Every copy of the map computed (:func:`boostlr.hf.moe_grouped.dropless`): sorted by
    expert once, each expert GEMM one grouped call on the sorted rows."""
    return moe_grouped.dropless(payload, route.token, route.expert, route.weight, experts, fn)


def with_capacity(
    payload: torch.Tensor, route: Routing, experts: int, capacity: int, fn: ExpertFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert takes at most ``capacity`` of the map's copies, in its priority order
    (:func:`boostlr.hf.moe_grouped.with_capacity`); returns (combined, dropped)."""
    return moe_grouped.with_capacity(
        payload, route.token, route.expert, route.weight, experts, capacity, fn
    )
