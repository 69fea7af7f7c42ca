"""Canaries for every private torch symbol boostlr uses (``boostlr._torch_internals``).

Each test pins what boostlr relies on (a name, a signature, a call-time lookup, a behaviour)
so that a torch release that moves or reshapes it fails here, naming the symbol, instead of
inside a rank's step. Run on every torch in the supported range (CI runs it on the floor too).
"""

from __future__ import annotations

import inspect
import io
import zipfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining import stage as stage_module

from boostlr import _torch_internals as ti


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_fsdp_collective_classes_take_the_call_boostlr_makes() -> None:
    """``_RecordedAllGather``/``_RecordedReduceScatter`` subclass these and call ``super()``."""
    assert _params(ti.DefaultAllGather.__call__)[:4] == [
        "output_tensor",
        "input_tensor",
        "group",
        "async_op",
    ]
    assert _params(ti.DefaultReduceScatter.__call__)[:5] == [
        "output_tensor",
        "input_tensor",
        "group",
        "op",
        "async_op",
    ]
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    assert hasattr(FSDPModule, "set_custom_all_gather")
    assert hasattr(FSDPModule, "set_custom_reduce_scatter")


def test_stage_backward_returns_input_grads() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    out = x @ w
    grad = torch.ones_like(out)
    grads = ti.stage_backward([out], [grad], [x])
    assert _params(ti.stage_backward)[:3] == ["stage_output", "output_grads", "input_values"]
    torch.testing.assert_close(grads[0], grad @ w.detach().T)
    torch.testing.assert_close(w.grad, x.detach().T @ grad)


def test_stage_backward_method_is_what_the_stage_calls() -> None:
    """``ShardedBackwardStage`` overrides this method; the stage must still call it per
    micro-batch with the keyword arguments the override reads."""
    method = getattr(PipelineStage, ti.STAGE_BACKWARD_METHOD)
    assert _params(method)[:3] == ["backward_type", "bwd_kwargs", "last_backward"]
    source = inspect.getsource(stage_module)
    assert f"self.{ti.STAGE_BACKWARD_METHOD}(" in source
    for key in ("stage_output", "output_grads", "input_values"):
        assert f'"{key}"' in source, key
    from boostlr.parallel.pipeline import ShardedBackwardStage

    assert ti.STAGE_BACKWARD_METHOD in vars(ShardedBackwardStage)  # the override's name


def test_in_backward_tells_the_autograd_engine_apart() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(ti.in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(ti.in_backward())
            return g

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_gloo_options_carry_a_timeout_into_a_group(tmp_path) -> None:
    options = ti.gloo_options()
    ti.set_group_timeout(options, timedelta(seconds=17))
    assert options._timeout == timedelta(seconds=17)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo", pg_options=options)
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_p2p_waits_are_looked_up_at_call_time_and_restored() -> None:
    """The schedules must call the module global ``_wait_batch_p2p`` (not a bound copy)."""
    source = inspect.getsource(schedules)
    assert source.count("_wait_batch_p2p(") >= 2
    inner = schedules._wait_batch_p2p
    calls = []

    def wrap(fn):
        def waited(work):
            calls.append(len(work))
            return fn(work)

        return waited

    with ti.wrapped_p2p_waits(wrap):
        assert schedules._wait_batch_p2p is not inner
        schedules._wait_batch_p2p([])
    assert schedules._wait_batch_p2p is inner and calls == [0]


def _record_crcs(buffer: io.BytesIO) -> list[int]:
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return [info.CRC for info in archive.infolist() if "/data/" in info.filename]


def test_torch_save_without_crc_writes_zero_crcs_and_still_loads() -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    with_crc, without = io.BytesIO(), io.BytesIO()
    torch.save(tensor, with_crc)
    with ti.torch_save_without_crc():
        torch.save(tensor, without)
    assert all(_record_crcs(with_crc)) and _record_crcs(with_crc)
    assert set(_record_crcs(without)) == {0}
    without.seek(0)
    assert torch.equal(torch.load(without), tensor)
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True  # restored


def test_compiler_hooks() -> None:
    config = ti.compiler_config()
    assert hasattr(config, "recompile_limit") or hasattr(config, "cache_size_limit")
    assert isinstance(ti.has_triton(), bool)
    assert isinstance(ti.cpp_compiler_available(), bool)


def test_compiled_graphs_counts_a_capture() -> None:
    before = ti.compiled_graphs()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    fn(torch.ones(3))
    assert ti.compiled_graphs() == before + 1
    fn(torch.ones(3))  # the same shapes: no new graph
    assert ti.compiled_graphs() == before + 1


@pytest.mark.parametrize("name", ti.__all__)
def test_every_export_resolves(name: str) -> None:
    assert getattr(ti, name) is not None
