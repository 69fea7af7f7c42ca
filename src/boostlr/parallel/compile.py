"""``train.compile``: ``torch.compile`` of a strategy's block, collectives left out.

Every collective entry point in :mod:`boostlr.parallel.collectives` is
``torch.compiler.disable``d, so a compiled block's graph breaks exactly at its collectives:
each collective-free region (a BTP region by construction, the code between two all-reduces
under Megatron/vanilla, the whole block at TP 1) becomes one graph, and the autograd
collectives run eagerly between them. Weights are graph inputs, so all blocks of a model
share the graphs (one for block 0, whose LaX input has no latents, one for the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from boostlr._torch_internals import compiler_config, cpp_compiler_available, has_triton
from boostlr.errors import ConfigError
from boostlr.platform import platform_for

_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}
# Graphs cached per block function: (first block, later blocks) x (train, no-grad eval) per
# model shape. torch's default limit (8) would silently send a process that builds several
# models (benchmarks, tests) back to eager.
RECOMPILE_LIMIT = 64


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One compiled wrapper per block function, shared by every model in the process.

    ``dynamic=False``: a run's shapes are fixed (training and evaluation batches alike),
    and static shapes give inductor the most room.
    """
    if fn not in _COMPILED:
        config = compiler_config()
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def check_toolchain(device: torch.device) -> None:
    """Fail before any work when inductor cannot build kernels for ``device``."""
    if not platform_for(device).is_host:
        if not has_triton():
            raise ConfigError(
                "train.compile true needs Triton for CUDA kernels (pip install triton): "
                "install it or set --train.compile false"
            )
        return
    if not cpp_compiler_available():
        raise ConfigError(
            "train.compile true needs a C++ compiler for inductor's CPU backend and none was "
            "found (g++, or $CXX): install one or set --train.compile false"
        )
