"""Evaluation gives every data-parallel rank batches of equal shapes.

With the vocabulary split over dp (``parallel.vocab_dp``) the evaluation all-gathers hidden
states and targets over dp; a short last batch on one rank would gather unequal sizes: a
hang or corrupted data on NCCL, and on gloo it may pass silently. So the ranks run under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which makes every collective check that all ranks call
it with the same shapes and dtypes, and the shapes are compared across ranks directly.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import DistributedTestError, run_distributed
from parallel_cases import VOCAB, layout_config

from boostlr.config import build_config
from boostlr.data import TokenDataset, val_batches
from boostlr.data.loader import split_validation
from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel
from boostlr.train import run as trainer

BATCH = 2
WINDOWS = 7  # odd: three whole batches of 2 and a short one of 1


def _windows(cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (WINDOWS, cfg.data.seq_len + 1), generator=gen)
    return [
        (tokens[i : i + BATCH, :-1], tokens[i : i + BATCH, 1:]) for i in range(0, WINDOWS, BATCH)
    ]


def evaluate_split(rank: int, world: int, raw: bool) -> dict:
    cfg = layout_config("cola", "btp", 1, 2, 1, **{"train.batch_size": BATCH})
    assert cfg.parallel.vocab_dp
    model = ParallelModel.build(cfg, torch.device("cpu"))
    assert model.stages[0].ctx.vocab_dp_size == 2  # the vocabulary is split over dp
    batches = _windows(cfg)
    dp = model.comms.dp
    if raw:  # the old deal: as many batches per rank, the short one included
        mine, usable, dropped = batches[dp.rank :: dp.size], None, 0
        assert len(batches) % dp.size == 0
    else:
        mine, usable = split_validation(batches, BATCH, dp.size, dp.rank)
        dropped = mine.dropped
    shapes = [tuple(x.shape) for x, _ in mine]
    every: list = [None] * world
    dist.all_gather_object(every, shapes)
    loss = model.evaluate(mine, nullcontext())
    kept = batches[:usable] if usable is not None else batches
    ref = build_model(cfg.model, seed=cfg.train.seed)
    with torch.no_grad():
        ref_loss = ref(torch.cat([x for x, _ in kept]), torch.cat([y for _, y in kept])).item()
    return {"shapes": every, "loss": loss, "ref_loss": ref_loss, "dropped": dropped}


def test_dp2_evaluates_equal_shapes_with_an_odd_number_of_windows(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    for r in run_distributed(evaluate_split, 2, False, timeout_s=300):
        assert r["shapes"][0] == r["shapes"][1] == [(BATCH, 8)], r["shapes"]
        assert r["dropped"] == WINDOWS - 2 * BATCH  # the short batch and the odd whole one
        # The mean over the kept windows, as one device computes it.
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"], r


def test_the_check_catches_unequal_shapes(monkeypatch) -> None:
    """The harness is not blind: the old deal (a short batch on one rank) is refused."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(
        DistributedTestError, match="differ in the following aspects: +Tensor Tensor shapes"
    ):
        run_distributed(evaluate_split, 2, True, timeout_s=120)


@pytest.mark.slow
def test_the_trainer_reports_the_windows_it_left_out(
    small_dataset: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    seq, batch = 32, 3
    overrides = {
        "model.preset": "tiny",
        "data.path": str(small_dataset),
        "data.seq_len": seq,
        "data.val_batches": 1000,  # the whole split
        "train.batch_size": batch,
        "train.steps": 1,
        "parallel.dp": 2,
        "parallel.device": "cpu",
    }
    cfg = build_config(overrides=list(overrides.items()))
    windows = sum(
        len(x) for x, _ in val_batches(TokenDataset(small_dataset, "val"), batch, seq, 10**6)
    )
    whole = windows // batch
    expected = windows - whole // 2 * 2 * batch
    assert expected > 0, windows  # the split leaves something out at this shape
    trainer.train(cfg, tmp_path / "run", console=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (val,) = [r for r in rows if "val_loss" in r]
    assert val["val_dropped"] == expected, (val, windows)
    assert f"{expected} window(s) left out" in capfd.readouterr().out
