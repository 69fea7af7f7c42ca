"""What the host dispatches: count a step's aten ops, and time the host's cost per op.

The cost model charges the host per dispatched aten op, views and casts to a tensor's own
dtype included (``analysis/fixed.py``): each pays Python, the dispatcher and autograd's
record whether or not it launches a kernel. The same classification serves the census
(``benchmarks/dispatch_census.py``: ops per block and strategy), the test that holds the
spec's ops per kernel (``tests/test_host_ops.py``) and ``boostlr calibrate`` (host seconds
per op on the trainer's own step).
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

VIEWS = frozenset(
    "aten::" + name
    for name in (
        "view", "view_as", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose",
        "permute", "expand", "expand_as", "slice", "select", "narrow", "as_strided", "unsqueeze",
        "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind",
        "detach", "alias", "lift_fresh", "mT", "numpy_T", "result_type",
    )
)  # fmt: skip
MAYBE_NOOP = frozenset({"aten::to", "aten::contiguous", "aten::type_as"})


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _outermost(event) -> bool:
    """Called from Python or autograd, not from inside another aten op."""
    parent = event.cpu_parent
    while parent is not None:
        if _is_aten(parent):
            return False
        parent = parent.cpu_parent
    return True


def classify(event) -> str:
    """``view``, ``noop`` (a cast or ``contiguous`` that called nothing: its input back) or
    ``write`` (an op that writes memory: a kernel on a GPU)."""
    if event.name in VIEWS:
        return "view"
    if event.name in MAYBE_NOOP and not any(_is_aten(c) for c in event.cpu_children):
        return "noop"
    return "write"


def count_dispatched(fn: Callable[[], object]) -> collections.Counter[str]:
    """The outermost aten ops one call of ``fn`` dispatches, by :func:`classify`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(classify(e) for e in prof.events() if _is_aten(e) and _outermost(e))


def host_seconds_per_op(step: Callable[[], object], reps: int = 20) -> tuple[float, int]:
    """(host CPU seconds per dispatched op, ops per call) of ``step``, warmed up.

    The calling thread's CPU time, not wall time: what the host spends dispatching, without
    the waits for a device (a GPU's kernels run on) or for a busy machine's other jobs.
    """
    for _ in range(3):
        step()
    ops = sum(count_dispatched(step).values())
    times = []
    for _ in range(reps):
        started = time.thread_time()
        step()
        times.append(time.thread_time() - started)
    return statistics.median(times) / ops, ops


def trainer_step(cfg, device: torch.device) -> Callable[[], None]:
    """One optimizer step of ``cfg``'s model as ``boostlr train`` runs it (built with
    ``ParallelModel`` in this process: its parameter handling, hooks and step included)."""
    from boostlr.parallel.engine import ParallelModel
    from boostlr.train.optim import build_optimizer, init_optimizer_state

    torch.manual_seed(cfg.train.seed)
    model = ParallelModel.build(cfg, device)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    init_optimizer_state(optimizer)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    inputs = torch.randint(0, cfg.model.vocab_size, shape, device=device)
    targets = torch.randint(0, cfg.model.vocab_size, shape, device=device)
    autocast = cfg.train.dtype == "bfloat16"

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model.forward_backward(inputs, targets)
        model.global_mean(loss)
        model.reduce_expert_gradients()
        model.clip_gradients(cfg.train.grad_clip)
        optimizer.step()

    return step


def step_census(cfg, device: torch.device) -> collections.Counter[str]:
    """:func:`count_dispatched` of one :func:`trainer_step` of ``cfg``, after two warm-up
    steps (the optimizer's state exists, caches are filled)."""
    step = trainer_step(cfg, device)
    for _ in range(2):
        step()
    return count_dispatched(step)
