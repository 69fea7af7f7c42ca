"""Every private torch symbol boostlr's training path uses, and nothing else.

torch promises nothing about underscored names or modules under ``_``-prefixed packages:
they move between releases, and a cluster image may pin any release in boostlr's range
(:mod:`boostlr._torch_floor`). Reaching them only through this module keeps that risk in
one file, and ``tests/test_torch_internals.py`` holds a canary per symbol that names it the
day a release moves or reshapes it. A version-specific workaround, if one is ever needed,
lives here too, with a test that fails without it on the version that needs it.

The trace package's fake world (:mod:`boostlr.trace.fake_world`) keeps its own private
imports (fake tensors, the pipelining schedules' fake-mode hooks): it traces, it does not
train, and it declares each of them in its docstring; its tests are its canaries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._backward import stage_backward

__all__ = [
    "DefaultAllGather",
    "DefaultReduceScatter",
    "STAGE_BACKWARD_METHOD",
    "compiled_graphs",
    "compiler_config",
    "cpp_compiler_available",
    "gloo_options",
    "has_triton",
    "in_backward",
    "set_group_timeout",
    "stage_backward",
    "torch_save_without_crc",
    "unflatten_mesh",
    "wrapped_p2p_waits",
]

# ``PipelineStage``'s per-micro-batch backward, which ``ShardedBackwardStage`` overrides to
# reshard FSDP after each micro-batch: ``(self, backward_type, bwd_kwargs, last_backward)``
# returning ``(input grads, param grads)``; ``bwd_kwargs`` carries ``stage_output``,
# ``output_grads`` and ``input_values`` for :func:`stage_backward`.
STAGE_BACKWARD_METHOD = "backward_maybe_with_nosync"


def in_backward() -> bool:
    """Whether the calling code runs inside the autograd engine (a backward pass).

    FSDP's pre-backward re-gather and gradient reduction run there; the ledger books them
    as backward traffic.
    """
    return torch._C._current_graph_task_id() != -1


def gloo_options() -> dist.ProcessGroup.Options:
    """gloo's backend options, the only way to give one mesh dimension its own timeout."""
    return dist.ProcessGroupGloo._Options()


def unflatten_mesh(
    mesh: DeviceMesh,
    dim: str,
    sizes: tuple[int, ...],
    names: tuple[str, ...],
    backend_override: dict[str, Any],
) -> DeviceMesh:
    """``mesh`` with dim ``dim`` split into ``names`` of ``sizes`` (the last fastest): the
    same ranks, new groups, one root mesh (``DeviceMesh._unflatten``; the expert mesh of
    :mod:`boostlr.parallel.mesh`). Canary: tests/test_moe_ep.py checks the groups' ranks.

    The dim goes by index: torch 2.11's ``_unflatten`` refuses every dim given by name (its
    name check is inverted there)."""
    index = list(mesh.mesh_dim_names or ()).index(dim)
    return mesh._unflatten(index, sizes, names, backend_override=backend_override)


def set_group_timeout(options: dist.ProcessGroup.Options, timeout: timedelta) -> None:
    """Set a backend options object's timeout (an underscored attribute on every backend)."""
    options._timeout = timeout


@contextmanager
def wrapped_p2p_waits(wrap: Callable[[Callable[[list], Any]], Callable[[list], Any]]):
    """Route every point-to-point wait of torch's pipeline schedules through ``wrap(inner)``.

    The schedules issue their sends and receives asynchronously and block in one
    module-level helper, ``_wait_batch_p2p``, looked up at call time: swapping it for the
    duration of a step times the waits (the bubble included) without copying a schedule.
    """
    inner = _schedules._wait_batch_p2p
    _schedules._wait_batch_p2p = wrap(inner)
    try:
        yield
    finally:
        _schedules._wait_batch_p2p = inner


@contextmanager
def torch_save_without_crc() -> Iterator[None]:
    """``torch.save`` without the zip CRC-32 of each record, for as long as the block runs.

    The switch is process-wide (``torch.utils.serialization.config``): a ``torch.save``
    elsewhere in the process in that window also skips its CRC, which ``torch.load``
    never checks.
    """
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = old


def compiler_config() -> Any:
    """``torch._dynamo.config``, where the recompile limit lives."""
    return torch._dynamo.config


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has captured in this process so far (dynamo's counter): a
    recompile shows as a new one, so a count that stops growing means no recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def has_triton() -> bool:
    """Whether inductor can build CUDA kernels (Triton importable and usable)."""
    from torch.utils._triton import has_triton as _has_triton

    return _has_triton()


def cpp_compiler_available() -> bool:
    """Whether inductor's CPU backend finds a C++ compiler (g++, or ``$CXX``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler (a multi-line message), or OSError
        return False
    return True
