"""No host sync on a step that logs nothing: the device is never waited on mid-window.

On a GPU every ``Tensor.item``, ``float(t)``, ``bool(t)``, ``t.tolist()`` and
``torch.cuda.synchronize`` makes the CPU wait for the device, so it cannot queue step N+1
while step N runs. Such conversions are counted here (patched for the run) over the steps
between two log rows, for one process, tp 2 and pp 2 x dp 2 (real gloo ranks): none may
happen there. On CPU the same calls are the proxy that is counted.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_train import tiny_run_config

from boostlr.train import run as trainer
from boostlr.train.profiling import StepProfiler

STEPS = 6  # log rows at step 1 and 6 (the last): steps 2-5 must not sync
CONVERSIONS = ("item", "__float__", "__bool__", "tolist", "__int__")


def count_conversions(cfg, run_dir: Path, rank_of_group: bool = False) -> dict[int, dict]:
    """Train, counting conversions per step (from its start to the next step's start).

    ``rank_of_group``: this process is one rank of an existing process group (the run
    directory is already written): it trains its part directly.
    """
    counts: dict[int, Counter] = {}
    current = {"step": 0}
    patched = {}

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            counts.setdefault(current["step"], Counter())[name] += 1
            return original(self, *args, **kwargs)

        return original, wrapper

    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        current["step"] = step
        before_step(self, step)

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
        if rank_of_group:
            datasets = trainer.open_datasets(cfg)
            trainer.bind_vocab(cfg, datasets[0])
            trainer._train_rank(cfg, run_dir, None, False, torch.device("cpu"), datasets)
        else:
            trainer.train(cfg, run_dir, console=False)
    finally:
        for name, (original, _) in patched.items():
            setattr(torch.Tensor, name, original)
        StepProfiler.before_step = before_step
        torch.cuda.synchronize = synchronize
    return {step: dict(c) for step, c in counts.items()}


def _config(data: Path, **extra):
    quiet = {"train.log_every": 100, "train.eval_every": 100, "train.ckpt_every": 100}
    return tiny_run_config(data, **{"train.steps": STEPS, **quiet, **extra})


def _rank_counts(rank: int, world: int, data: str, run_dir: str, extra: dict) -> dict:
    return count_conversions(_config(Path(data), **extra), Path(run_dir), rank_of_group=True)


def assert_quiet(per_step: dict[int, dict[str, int]]) -> None:
    for step in range(2, STEPS):
        assert not per_step.get(step), (step, per_step.get(step))
    assert per_step.get(STEPS), per_step  # the log step does read: the count is real


def test_one_process_steps_do_not_sync(small_dataset: Path, tmp_path: Path) -> None:
    assert_quiet(count_conversions(_config(small_dataset), tmp_path / "run"))


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
    trainer.bind_vocab(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    per_rank = run_distributed(_rank_counts, world, str(small_dataset), str(run_dir), layout)
    for per_step in per_rank:
        assert_quiet(per_step)
