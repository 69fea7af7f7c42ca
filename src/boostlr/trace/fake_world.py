"""Every torch-private piece the trace relies on, in one place (tests/test_plan_trace.py
checks each still exists and behaves, so a torch upgrade that moves one fails there first).

* ``torch.testing._internal.distributed.fake_pg``: importing it registers the ``fake``
  process-group backend; ``FakeStore`` is the store it starts from. A fake group gives one
  rank of any world size whose collectives and point-to-point calls return at once.
* ``torch._subclasses.fake_tensor``: ``FakeTensorMode`` (tensors with shape, dtype and a
  storage of the right size, but no memory) and ``unset_fake_temporarily``.
* ``DeviceMesh`` keeps its rank layout in a small real int tensor, and FSDP's 2-D
  (dp x tp) path builds new meshes from it (``DeviceMesh._concatenate`` in torch 2.13) while
  the model is being wrapped, i.e. under the fake mode: ``nonzero`` on a fake tensor has no
  known shape and fails. :func:`fake_tensors` runs every ``DeviceMesh`` method with the fake
  mode suspended; its rank bookkeeping is the real one of a fake world.
* ``torch.distributed.pipelining``: before its first step a schedule has every stage vote
  (a 1-element send/recv chain, then ``.item()``) on whether shapes are static. A fake
  receive carries nothing, and ``.item()`` of a fake tensor has no value, so
  :func:`fake_tensors` has each stage take its own vote: every boostlr stage declares its
  input and output shapes (``parallel/pipeline.py``), so the real vote is unanimous.
* ``ShardingPropagator._propagate_tensor_meta_non_cached``: DTensor works out an
  operator's output shape by running it on global-shape fake tensors, made in the fake mode
  already active (the trace's) or a fresh one (a real run's). They hold no memory on any
  device: :func:`shape_propagation_paused` has a counter look away meanwhile.
* For the storage counter: ``torch.utils._python_dispatch`` (``TorchDispatchMode``, the
  test for a wrapper subclass such as DTensor), ``torch._C._current_graph_task_id``
  (whether the autograd engine is running: backward), a storage's identity
  (``UntypedStorage._cdata``, the address of its implementation) and whether an operator
  may mutate its arguments (``OpOverload._schema.is_mutable``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import schedules as _schedules

try:  # torch >= 2.13: a schedule's stages vote on static shapes before the first step
    from torch.distributed.pipelining._utils import InferenceMode
except ImportError:  # older: no vote; a stage with declared shapes infers nothing
    InferenceMode = None
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

FAKE_BACKEND = "fake"

__all__ = [
    "FAKE_BACKEND",
    "FakeTensor",
    "fake_mode_of",
    "fake_tensors",
    "init_fake_world",
    "is_fake",
    "in_backward",
    "mutates",
    "storage_key",
    "is_traceable_wrapper_subclass",
    "shape_propagation_paused",
    "TorchDispatchMode",
]


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of the storage behind a Python storage object (views share it)."""
    return storage._cdata


def mutates(func: Any) -> bool:
    """Whether operator overload ``func`` may write to (or resize) its arguments."""
    return func._schema.is_mutable


def in_backward() -> bool:
    """Whether the autograd engine is running (an operator of a backward pass)."""
    return torch._C._current_graph_task_id() != -1


def init_fake_world(rank: int, world_size: int) -> None:
    """The default process group of a fake world: this rank of ``world_size``, no peers."""
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)


def is_fake(tensor: Any) -> bool:
    return isinstance(tensor, FakeTensor)


def fake_mode_of(tensor: Any) -> FakeTensorMode | None:
    """The fake mode a fake tensor belongs to; ``None`` for a real tensor."""
    return tensor.fake_mode if isinstance(tensor, FakeTensor) else None


def _real(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapper


_KEEP = ("__init__", "__getitem__")


@contextmanager
def _real_device_mesh() -> Iterator[None]:
    """Every ``DeviceMesh`` method (and property) runs on real tensors, then is put back."""
    saved: dict[str, Any] = {}
    for name, attr in list(vars(DeviceMesh).items()):
        if name.startswith("__") and name not in _KEEP:
            continue
        if isinstance(attr, property):
            new: Any = property(
                _real(attr.fget) if attr.fget else None, attr.fset, attr.fdel, attr.__doc__
            )
        elif isinstance(attr, staticmethod):
            new = staticmethod(_real(attr.__func__))
        elif isinstance(attr, classmethod):
            new = classmethod(_real(attr.__func__))
        elif callable(attr):
            new = _real(attr)
        else:
            continue
        saved[name] = attr
        setattr(DeviceMesh, name, new)
    try:
        yield
    finally:
        for name, attr in saved.items():
            setattr(DeviceMesh, name, attr)


def _local_vote(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
    for stage in stages:
        if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
            raise RuntimeError(
                f"pipeline stage {stage.stage_index} has no declared shapes: a fake world "
                "cannot infer them (its receives carry nothing)"
            )
        stage._inference_mode = InferenceMode.STATIC


@contextmanager
def _local_pipeline_vote() -> Iterator[None]:
    schedule = _schedules._PipelineSchedule
    if InferenceMode is None:
        yield
        return
    saved = schedule._warmup_p2p
    schedule._warmup_p2p = _local_vote  # type: ignore[method-assign]
    try:
        yield
    finally:
        schedule._warmup_p2p = saved  # type: ignore[method-assign]


@contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Tensors made inside are fake; real inputs (a mesh's rank table) are converted."""
    with (
        _real_device_mesh(),
        _local_pipeline_vote(),
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
    ):
        yield mode


@contextmanager
def shape_propagation_paused(counter: Any) -> Iterator[None]:
    """``counter.paused`` is raised while DTensor propagates shapes on fake tensors."""
    saved = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.paused += 1
        try:
            return saved(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = saved  # type: ignore[method-assign]
