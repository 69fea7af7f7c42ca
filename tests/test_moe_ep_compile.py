"""``train.compile`` with expert parallelism (docs/moe.md, "Compile").

A capacity at dp 2 x ep 2 moves fixed-shape buffers and reads nothing back to the host, so
the compiled MoE blocks are captured in the first two steps (a log step and a quiet one) and
reused by every later one: the graph count after step 2 is the count before step 20 (no
recompile, the log step 10 included). Dropless ep under
``train.compile`` is refused in one line (exit 2): its all-to-all sizes change with every
micro-batch's routing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_train import read_rows, tiny_run_config

from boostlr._torch_internals import compiled_graphs
from boostlr.cli import main
from boostlr.config import resolve
from boostlr.train import run as trainer
from boostlr.train.profiling import StepProfiler

STEPS = 20
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 32}
LAYOUT = {**MOE, "parallel.dp": 2, "parallel.ep": 2, "model.moe_capacity": 1.0}
QUIET = {"train.log_every": 10, "train.eval_every": 100, "train.ckpt_every": 100}


def _graphs_per_step(rank: int, world: int, data: str, run_dir: str, overrides: dict) -> dict:
    """Train this rank's part, noting the process's captured graphs at each step's start."""
    cfg = tiny_run_config(Path(data), **overrides)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    seen: dict[int, int] = {}
    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        seen[step] = compiled_graphs()
        before_step(self, step)

    StepProfiler.before_step = mark
    try:
        trainer._train_rank(cfg, Path(run_dir), None, False, torch.device("cpu"), datasets)
    finally:
        StepProfiler.before_step = before_step
    seen[STEPS + 1] = compiled_graphs()
    return seen


@pytest.mark.slow
def test_capacity_at_ep2_compiles_once(small_dataset: Path, tmp_path: Path) -> None:
    overrides = {**LAYOUT, **QUIET, "train.steps": STEPS, "train.compile": True}
    overrides.update({"model.n_layers": 2, "train.batch_size": 2})
    run_dir = tmp_path / "run"
    cfg = tiny_run_config(small_dataset, **overrides)
    datasets = trainer.open_datasets(cfg)
    cfg = resolve(cfg, datasets[0])
    trainer.prepare_run_dir(cfg, run_dir, False, datasets[0])
    per_rank = run_distributed(
        _graphs_per_step, 2, str(small_dataset), str(run_dir), overrides, timeout_s=900
    )
    for seen in per_rank:
        assert seen[STEPS + 1] > 0, seen  # the blocks were compiled
        # Steps 1 and 2 capture the log step's and the quiet step's graphs (first block and
        # the rest); steps 3 to 19, the log step 10 included, capture nothing new. (Step 20
        # evaluates, whose no-grad graphs come after.)
        assert seen[3] == seen[STEPS], seen
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 10, 20]


def test_dropless_ep_under_compile_is_refused(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--run-dir", str(tmp_path / "run"), "--data.path", str(small_dataset)]
    args += ["--model.preset", "tiny", "--parallel.device", "cpu", "--train.compile", "true"]
    for key, value in {**MOE, "parallel.dp": 2, "parallel.ep": 2}.items():
        args += [f"--{key}", str(value)]
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "train.compile" in err[0] and "model.moe_capacity" in err[0], err
    assert not (tmp_path / "run").exists()
