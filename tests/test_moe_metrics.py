"""The MoE keys of a step row (docs/metrics.md): expert loads, dropped copies, balance state.

Counted by hand from the routing itself on real gloo dp ranks (the same on every rank), in
the trainer's rows and TensorBoard-ready scalars, drawn by ``boostlr plot``; a dense run's
rows keep their keys. tests/test_host_syncs.py checks that quiet steps record nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from parallel_cases import SEQ, global_batch, layout_config
from test_train import read_rows, tiny_run_config

from boostlr.cli import main
from boostlr.models.moe import moe_layers
from boostlr.parallel.engine import ParallelModel
from boostlr.rundir.checkpoint import load_model_state, open_checkpoint
from boostlr.specs.moe import capacity_of
from boostlr.train import run as trainer
from boostlr.train.sinks import scalars

MOE_KEYS = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
ROW_KEYS = {"moe_load/0", "moe_load/1", "moe_load_max_over_mean", "moe_dropped"}
ACCUM = 2


def _one_step(rank: int, world: int, extra: dict) -> dict:
    """One step of two micro-batches on this dp rank, its routing captured by router hooks."""
    cfg = layout_config(
        "cola", "auto", 1, world, 1, **MOE_KEYS, **extra, **{"train.grad_accum": ACCUM}
    )
    model = ParallelModel.build(cfg, torch.device("cpu"))
    layers = [layer for part in model.stages for layer in moe_layers(part.model)]
    routed: dict[int, list] = {layer.layer_index: [] for layer in layers}
    for layer in layers:
        layer.router.register_forward_hook(
            lambda _m, _i, out, i=layer.layer_index: routed[i].append(
                (_choices(out), out.scores.detach().clone())
            )
        )
    model.begin_step(logs=True)
    b = cfg.train.batch_size
    for micro in range(ACCUM):
        inputs, targets = global_batch(cfg, step=micro)
        mine = slice(model.comms.dp.rank * b, (model.comms.dp.rank + 1) * b)
        model.forward_backward(inputs[mine], targets[mine])
    return {"metrics": model.log_metrics(), "routed": routed}


def _choices(route) -> torch.Tensor:
    """The top-k router's map as ``[tokens, k]`` expert indices (its copies are choice-major)."""
    return route.expert.view(-1, route.tokens).t().clone()


def _hand_count(ranks: list[dict], capacity: float, aux_coef: float) -> dict:
    """The row's MoE keys from the captured routing of every rank (first forwards only)."""
    experts, k = MOE_KEYS["model.moe_experts"], MOE_KEYS["model.moe_top_k"]
    row: dict[str, float] = {}
    dropped, losses = 0, []
    for layer in ranks[0]["routed"]:
        load = torch.zeros(experts, dtype=torch.int64)
        for rank in ranks:
            forwards = rank["routed"][layer]  # a re-forward follows its forward: skipped
            for idx, scores in forwards[:: len(forwards) // ACCUM]:
                counts = torch.bincount(idx.reshape(-1), minlength=experts)
                load += counts
                if capacity:
                    cap = capacity_of(idx.shape[0], k, experts, capacity)
                    dropped += int((counts - cap).clamp(min=0).sum())
                seqs = idx.view(-1, SEQ, k)
                chosen = torch.zeros(seqs.shape[0], SEQ, experts).scatter_(-1, seqs, 1.0)
                f = chosen.sum(1) * experts / (k * SEQ)
                p = scores.view(-1, SEQ, experts).mean(1)
                losses.append(aux_coef * float((f * p).sum(-1).mean()))
        row[f"moe_load/{layer}"] = float(load.max()) / (float(load.sum()) / experts)
    row["moe_load_max_over_mean"] = max(row.values())
    row["moe_dropped"] = dropped
    if aux_coef:
        row["moe_aux_loss"] = sum(losses) / len(losses)
    return row


@pytest.mark.parametrize(
    "extra",
    [
        {"model.moe_capacity": 0.5, "model.moe_balance": "aux", "model.moe_aux_coef": 0.1},
        {"model.moe_capacity": 0.75, "parallel.act_ckpt": "block"},
        {},
    ],
    ids=["capacity-aux", "capacity-bias-block-ckpt", "dropless-bias"],
)
def test_dp2_ranks_log_the_hand_count(extra: dict) -> None:
    ranks = run_distributed(_one_step, 2, extra, timeout_s=300)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # every rank logs the same
    got = ranks[0]["metrics"]
    capacity = float(extra.get("model.moe_capacity", 0))
    want = _hand_count(ranks, capacity, float(extra.get("model.moe_aux_coef", 0.0)))
    assert set(got) == set(want) | ({"moe_bias_spread"} if "moe_aux_loss" not in want else set())
    for key, value in want.items():
        rel = 1e-6 if key == "moe_aux_loss" else 1e-12  # the balance loss is fp32
        assert got[key] == pytest.approx(value, rel=rel), key
    assert (got["moe_dropped"] > 0) == bool(capacity)  # the small capacities do drop
    if "moe_bias_spread" in got:
        assert got["moe_bias_spread"] == 0.0  # no optimizer step, no bias move yet
    if "parallel.act_ckpt" in extra:  # the re-forward routed the same copies again
        routed = ranks[0]["routed"][0]
        assert len(routed) == 2 * ACCUM and torch.equal(routed[0][0], routed[1][0])


def test_rows_carry_the_keys_and_plot_draws_them(small_dataset: Path, tmp_path: Path) -> None:
    """Every step row of an MoE run has the keys; the bias spread is the saved biases';
    ``boostlr plot --y`` draws a per-layer load and the dropped copies."""
    run = tmp_path / "moe"
    extra = {"train.steps": 3, "train.eval_every": 100, "model.moe_capacity": 0.5}
    trainer.train(tiny_run_config(small_dataset, **MOE_KEYS, **extra), run, console=False)
    steps = [r for r in read_rows(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert ROW_KEYS | {"moe_bias_spread"} <= set(row), row
        assert "moe_aux_loss" not in row
        assert row["moe_load_max_over_mean"] >= 1.0 and row["moe_dropped"] > 0
        assert ROW_KEYS <= set(scalars(row))  # what TensorBoard and W&B are given
    state = load_model_state(open_checkpoint(run / "checkpoints" / "step_3"))
    biases = [state[f"layers.{i}.mlp.router.expert_bias"] for i in (0, 1)]
    spread = max(float(b.max() - b.min()) for b in biases)
    assert steps[-1]["moe_bias_spread"] == pytest.approx(spread) and spread > 0
    for key in ("moe_load/1", "moe_dropped", "moe_bias_spread"):
        out = tmp_path / f"{key.replace('/', '_')}.png"
        assert main(["plot", str(run), "--out", str(out), "--y", key]) == 0
        assert out.stat().st_size > 0
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png"), "--y", "moe_aux_loss"]) == 2


def test_dense_rows_have_no_moe_keys(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "dense"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 2}), run, console=False)
    steps = [r for r in read_rows(run) if "loss" in r]
    assert len(steps) == 2 and not any(k.startswith("moe_") for r in steps for k in r)
    model = ParallelModel.build(layout_config("cola", "auto", 1, 1, 1), torch.device("cpu"))
    assert moe_layers(model.stages[0].model) == [] and model.hooks == []
    model.begin_step(logs=True)
    assert model.log_metrics() == {}


def test_a_step_without_forwards_logs_no_moe_keys() -> None:
    """Recording started but no forward ran (nothing to count): no key, rather than a 0/0."""
    cfg = layout_config("cola", "auto", 1, 1, 1, **MOE_KEYS)
    model = ParallelModel.build(cfg, torch.device("cpu"))
    layers = moe_layers(model.stages[0].model)
    model.begin_step(logs=True)
    assert model.log_metrics() == {}
    assert all(layer.take_stats() is None for layer in layers)  # recording stopped
