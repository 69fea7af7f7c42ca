"""Seeded initial values keyed by the parameter's name, drawable one slice at a time.

Element ``i`` of parameter ``name`` is a pure function of ``(seed, name, i)``: a
counter-based normal (:mod:`boostlr.models.philox`) scaled by the parameter's init std. So
a value does not depend on which other parameters exist on a rank, and a pipeline stage or
a tensor-parallel shard draws only the slices it holds, on its own device, equal bit for
bit to the same slices of the single-device model's init for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from boostlr.config import ModelConfig
from boostlr.models.lowrank import cola_std
from boostlr.models.moe_experts import moe_init_rule
from boostlr.models.philox import HOST_CHUNK_COUNTERS, normal_box, stream_key
from boostlr.models.shapes import block_linear, linear_shapes

Box = Sequence[tuple[int, int]]


def init_rule(cfg: ModelConfig, name: str) -> float | str:
    """``"ones"``, ``"zeros"`` or the std of the normal that parameter ``name`` starts from."""
    if name.endswith("norm.weight"):  # RMSNorm gains, LaX's LN_r included
        return "ones"
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return cfg.init_std
    moe = moe_init_rule(cfg, name)  # before the dense rules: its linears have the same names
    if moe is not None:
        return moe
    if ".cross." in name:
        # The gate's output starts at zero, so a fresh LaX model equals CoLA with LN_r; the
        # factored gate's first half is random so gradients reach both halves.
        if name.endswith("cross.gate_down.weight"):
            return cola_std(cfg.rank, cfg.rank, cfg.lax_gate_rank)
        return "zeros"
    linear = block_linear(name)
    if linear is not None and name.endswith((".down.weight", ".up.weight")):
        d_in, d_out = linear_shapes(cfg)[linear]
        return cola_std(d_in, d_out, cfg.rank)
    if linear is not None:
        return cfg.init_std  # a dense block linear
    raise ValueError(f"no initialisation rule for parameter {name!r}")


def initial_value(
    cfg: ModelConfig,
    name: str,
    shape: Sequence[int],
    seed: int,
    box: Box | None = None,
    device: torch.device | str = "cpu",
    draw: bool = True,
    chunk: int = HOST_CHUNK_COUNTERS,
) -> torch.Tensor:
    """Parameter ``name``'s initial value (fp32): whole, or only ``box`` of it.

    ``box`` is one ``(start, end)`` per dim of the full ``shape``; the result equals the
    whole value's slice bit for bit and costs only the slice's elements. ``draw=False`` gives
    an uninitialised tensor of the same shape: a trace on fake tensors has no values to draw
    (and the inverse CDF's data-dependent tail split cannot run there). ``chunk``: counters
    per step of the draw (speed only).
    """
    box = [(0, n) for n in shape] if box is None else list(box)
    rule = init_rule(cfg, name)
    size = [b - a for a, b in box]
    if not draw:
        return torch.empty(size, device=device)
    if rule == "ones":
        return torch.ones(size, device=device)
    if rule == "zeros":
        return torch.zeros(size, device=device)
    key = stream_key("init", seed, name)
    return normal_box(key, shape, box, std=rule, device=device, chunk=chunk)
