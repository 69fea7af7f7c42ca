"""No host sync on a step that logs nothing: the device is never waited on mid-window.

On a GPU every ``Tensor.item``, ``float(t)``, ``bool(t)``, ``t.tolist()`` and
``torch.cuda.synchronize`` makes the CPU wait for the device, so it cannot queue step N+1
while step N runs. Such conversions are counted here (patched for the run) over the steps
between two log rows, for one process, tp 2 and pp 2 x dp 2 (real gloo ranks): none may
happen there. On CPU the same calls are the proxy that is counted.

Feeding a batch is the other way to stall a GPU: a copy from pageable host memory waits for
the device. So every batch must be built in the device module's host buffers (pinned on a
GPU) and cross only through its ``to_device`` (non-blocking there): the way each batch
takes is watched here too, and what that way does for a CUDA target is asked of the device
module's pure ``copy_steps``. With ``BOOSTLR_SYNC_CHECK_DEVICE=cuda`` (the GPU check) the
one-process run trains on the GPU and its quiet steps run under
``torch.cuda.set_sync_debug_mode("error")``, so any synchronising call there raises.
An MoE model at ep 1 syncs nowhere either (grouped experts on device offsets); expert
parallelism is the one counted exception: its dropless all-to-all reads each MoE layer's
gathered counts back once per micro-batch (docs/moe.md), and exactly that is asserted at
dp 2 x ep 2; a capacity at dp 2 x ep 2 reads none; the MoE keys of a step row are recorded
and read on log steps only.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_train import read_rows, tiny_run_config

from boostlr.config import resolve
from boostlr.data import loader as loader_module
from boostlr.models.moe import MoEMLP
from boostlr.parallel import engine as engine_module
from boostlr.platform import CopyPlan, platform_for
from boostlr.platform import copies as copies_module
from boostlr.train import run as trainer
from boostlr.train.profiling import StepProfiler
from boostlr.train.stopping import StopCheck

STEPS = 6  # log rows at step 1 and 6 (the last): steps 2-5 must not sync
CONVERSIONS = ("item", "__float__", "__bool__", "tolist", "__int__")
DEVICE = os.environ.get("BOOSTLR_SYNC_CHECK_DEVICE", "cpu")  # "cuda" in the GPU check
PLANNED, PAGEABLE, BYPASS = "h2d from host_buffer", "h2d pageable", "device move outside to_device"


def _moves_device(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(...)`` arguments that name a device (not only a dtype)."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)


def watch_batches(stack: ExitStack, note) -> None:
    """Watch (the originals still run) each batch's way to the device: built by the
    loader in ``host_buffer``, moved by ``to_device`` only, never by a ``.to(device)`` of
    its own. ``note(key)`` counts, for the step under way."""
    buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    inside = {"to_device": 0}

    def from_buffer(t: torch.Tensor) -> bool:
        return buffers.get(id(t)) is t

    make = loader_module.host_buffer

    def host_buffer(*args, **kwargs):
        t = make(*args, **kwargs)
        buffers[id(t)] = t
        return t

    move = copies_module.to_device

    def to_device(t, device):
        note(PLANNED if from_buffer(t) else PAGEABLE)
        inside["to_device"] += 1
        try:
            return move(t, device)
        finally:
            inside["to_device"] -= 1

    tensor_to = torch.Tensor.to

    def watched_to(self, *args, **kwargs):
        if not inside["to_device"] and from_buffer(self) and _moves_device(args, kwargs):
            note(BYPASS)
        return tensor_to(self, *args, **kwargs)

    for owner, name, value in (
        (loader_module, "host_buffer", host_buffer),
        (copies_module, "to_device", to_device),
        (engine_module, "to_device", to_device),
        (torch.Tensor, "to", watched_to),
    ):
        stack.callback(setattr, owner, name, getattr(owner, name))
        setattr(owner, name, value)


def count_conversions(
    cfg, run_dir: Path, rank_of_group: bool = False
) -> tuple[dict[int, dict], dict[int, dict]]:
    """Train, counting conversions and batch copies per step (from its start to the next
    step's start); the quiet steps run under CUDA's sync debug mode "error" on a GPU.

    ``rank_of_group``: this process is one rank of an existing process group (the run
    directory is already written): it trains its part directly.
    """
    counts: dict[int, Counter] = {}
    copies: dict[int, Counter] = {}
    current = {"step": 0}
    patched = {}
    device = torch.device(cfg.parallel.device)
    debug = ExitStack()

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            counts.setdefault(current["step"], Counter())[name] += 1
            return original(self, *args, **kwargs)

        return original, wrapper

    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        current["step"] = step
        debug.close()  # a log step (1, STEPS) may read the device
        if 1 < step < STEPS:
            debug.enter_context(platform_for(device).sync_debug(device, "error"))
        before_step(self, step)

    def note_copy(key: str) -> None:
        copies.setdefault(current["step"], Counter())[key] += 1

    synchronize = torch.cuda.synchronize

    def counted_sync(*args, **kwargs):
        counts.setdefault(current["step"], Counter())["cuda.synchronize"] += 1
        return synchronize(*args, **kwargs)

    for name in CONVERSIONS:
        patched[name] = counting(name)
        setattr(torch.Tensor, name, patched[name][1])
    StepProfiler.before_step = mark
    torch.cuda.synchronize = counted_sync
    try:
        with ExitStack() as watching:
            watch_batches(watching, note_copy)
            if rank_of_group:
                datasets = trainer.open_datasets(cfg)
                cfg = resolve(cfg, datasets[0])
                trainer._train_rank(cfg, run_dir, None, False, device, datasets)
            else:
                trainer.train(cfg, run_dir, console=False)
    finally:
        debug.close()
        for name, (original, _) in patched.items():
            setattr(torch.Tensor, name, original)
        StepProfiler.before_step = before_step
        torch.cuda.synchronize = synchronize
    return {step: dict(c) for step, c in counts.items()}, {s: dict(c) for s, c in copies.items()}


def _config(data: Path, **extra):
    quiet = {"train.log_every": 100, "train.eval_every": 100, "train.ckpt_every": 100}
    return tiny_run_config(data, **{"train.steps": STEPS, **quiet, **extra})


def assert_batches_take_the_planned_way(per_step: dict[int, dict[str, int]]) -> None:
    """Every quiet step feeds its batches from host buffers through ``to_device`` only."""
    for step in range(2, STEPS):
        seen = per_step.get(step, {})
        assert seen.get(PLANNED, 0) >= 2, (step, seen)  # the watch is real: copies seen
        assert set(seen) == {PLANNED}, (step, seen)


def _rank_counts(rank: int, world: int, data: str, run_dir: str, extra: dict) -> tuple:
    return count_conversions(_config(Path(data), **extra), Path(run_dir), rank_of_group=True)


def _rank_counts_and_stop_checks(
    rank: int, world: int, data: str, run_dir: str, extra: dict
) -> tuple:
    """:func:`_rank_counts`, and the stop checks (train/stopping.py) that all-reduced a flag
    over their gloo group: one per step, counted among the conversions they must not make."""
    checks = []
    check = StopCheck.check

    def counted(self, save_s):
        checks.append(self.group is not None and self._flag.device.type == "cpu")
        return check(self, save_s)

    StopCheck.check = counted
    try:
        return (*_rank_counts(rank, world, data, run_dir, extra), checks)
    finally:
        StopCheck.check = check


def assert_quiet(per_step: dict[int, dict[str, int]]) -> None:
    for step in range(2, STEPS):
        assert not per_step.get(step), (step, per_step.get(step))
    assert per_step.get(STEPS), per_step  # the log step does read: the count is real


def test_one_process_steps_do_not_sync(small_dataset: Path, tmp_path: Path) -> None:
    cfg = _config(small_dataset, **{"parallel.device": DEVICE})
    conversions, copies = count_conversions(cfg, tmp_path / "run")
    assert_quiet(conversions)
    assert_batches_take_the_planned_way(copies)


def test_moe_steps_at_ep1_do_not_sync(small_dataset: Path, tmp_path: Path) -> None:
    """Dropless MoE at ep 1 (docs/moe.md): the copies are sorted by expert on the device and
    every expert GEMM is one grouped call on device offsets (the sorted row count T·k is
    known), so no count is read back: the quiet steps sync nowhere. In bf16, the dtype a GPU's
    grouped kernel takes (compute capability 9.x/10.x; elsewhere the experts run padded,
    which reads the busiest expert's count back)."""
    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
    run = {"train.grad_accum": 2, "train.dtype": "bfloat16", "parallel.device": DEVICE}
    cfg = _config(small_dataset, **moe, **run)
    conversions, copies = count_conversions(cfg, tmp_path / "run")
    assert_quiet(conversions)
    assert_batches_take_the_planned_way(copies)


def test_moe_ep2_steps_sync_once_per_dropless_layer_and_micro_batch(
    small_dataset: Path, tmp_path: Path
) -> None:
    """dp 2 x ep 2 (real gloo ranks): the all-to-all dispatch reads the exchanged counts back
    once per MoE layer and micro-batch (to size the payload all-to-all); the count exchange,
    the payload, the experts' dp_rep all-reduce and the clipping across meshes add none."""
    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
    layout = {**moe, "parallel.dp": 2, "parallel.ep": 2, "train.grad_accum": 2}
    run_dir = tmp_path / "run"
    cfg = _config(small_dataset, **layout)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    per_rank = run_distributed(_rank_counts, 2, str(small_dataset), str(run_dir), layout)
    per_step = {"tolist": cfg.model.n_layers * cfg.train.grad_accum}
    for conversions, copies in per_rank:
        for step in range(2, STEPS):
            assert conversions.get(step) == per_step, (step, conversions.get(step))
        assert_batches_take_the_planned_way(copies)


def test_moe_ep2_capacity_steps_do_not_sync(small_dataset: Path, tmp_path: Path) -> None:
    """A capacity at dp 2 x ep 2 (real gloo ranks): the all-to-alls move fixed
    ``[ep, E/ep, capacity, width]`` buffers, so no counts are read back: quiet steps make no
    conversion at all (dropless ep makes one per MoE layer and micro-batch, above)."""
    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
    layout = {**moe, "model.moe_capacity": 1.0, "parallel.dp": 2, "parallel.ep": 2}
    layout["train.grad_accum"] = 2
    run_dir = tmp_path / "run"
    cfg = _config(small_dataset, **layout)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    per_rank = run_distributed(_rank_counts, 2, str(small_dataset), str(run_dir), layout)
    for conversions, copies in per_rank:
        assert_quiet(conversions)
        assert_batches_take_the_planned_way(copies)


def test_moe_metrics_are_read_on_log_steps_only(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MoE keys of a step row (expert loads, dropped copies, balance loss) are recorded
    and read on log steps only: with a capacity (no dropless sync) the quiet steps make no
    conversion and record no routing, and the log step's row carries the keys."""
    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
    aux = {"model.moe_capacity": 1.0, "model.moe_balance": "aux", "train.grad_accum": 2}
    cfg = _config(small_dataset, **moe, **aux, **{"parallel.device": DEVICE})
    recorded: Counter = Counter()
    record = MoEMLP._record

    def counted(self, route):
        recorded[step_of["step"]] += 1
        return record(self, route)

    step_of = {"step": 0}
    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        step_of["step"] = step
        before_step(self, step)

    monkeypatch.setattr(MoEMLP, "_record", counted)
    monkeypatch.setattr(StepProfiler, "before_step", mark)
    conversions, _ = count_conversions(cfg, tmp_path / "run")
    assert_quiet(conversions)
    forwards = cfg.model.n_layers * cfg.train.grad_accum
    assert set(recorded) == {1, STEPS}, recorded
    assert all(n == forwards for n in recorded.values()), recorded
    rows = [r for r in read_rows(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, STEPS]
    assert all({"moe_load_max_over_mean", "moe_dropped", "moe_aux_loss"} <= set(r) for r in rows)


def test_a_batch_copy_to_a_gpu_never_makes_the_host_wait() -> None:
    """What ``to_device`` does with a batch bound for a GPU, asked without one: a batch from
    ``host_buffer`` is pinned there (so it is copied as it is), and the copy is queued."""
    gpu = torch.device("cuda", 0)
    plan = platform_for(gpu).copy_plan
    assert plan.pin and plan.non_blocking and plan.side_stream  # host_buffer pins under it
    pageable = torch.arange(8)
    assert copies_module.copy_steps(pageable, gpu) == (True, True)  # pinned first, queued
    assert copies_module.copy_steps(pageable, torch.device("cpu")) is None
    assert platform_for("cpu").copy_plan == CopyPlan(False, False, False)


def test_the_watch_sees_a_batch_moved_around_to_device(small_dataset: Path, tmp_path) -> None:
    """The old feeding, ``inputs.to(self.device)`` in the engine, is caught."""

    def forward_backward(self, inputs, targets):
        return original(self, inputs.to(self.device), targets.to(self.device))

    original = engine_module.ParallelModel.forward_backward
    engine_module.ParallelModel.forward_backward = forward_backward
    try:
        _, copies = count_conversions(_config(small_dataset), tmp_path / "run")
    finally:
        engine_module.ParallelModel.forward_backward = original
    assert all(copies[step].get(BYPASS) for step in range(2, STEPS)), copies


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [{"parallel.tp": 2}, {"parallel.pp": 2, "parallel.dp": 2, "model.n_layers": 2}],
    ids=["tp2", "pp2dp2"],
)
def test_distributed_steps_do_not_sync(small_dataset: Path, tmp_path: Path, layout) -> None:
    world = (
        layout.get("parallel.tp", 1) * layout.get("parallel.pp", 1) * layout.get("parallel.dp", 1)
    )
    run_dir = tmp_path / "run"
    cfg = _config(small_dataset, **layout)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    per_rank = run_distributed(
        _rank_counts_and_stop_checks, world, str(small_dataset), str(run_dir), layout
    )
    for conversions, copies, stop_checks in per_rank:
        assert_quiet(conversions)  # the stop checks of the quiet steps included
        assert stop_checks == [True] * STEPS  # each step all-reduced a host flag over gloo
        assert_batches_take_the_planned_way(copies)
