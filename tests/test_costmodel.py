"""The cost model against what runs: ledger bytes, parameter memory, plan's contract.

Every layout the TP and 3D tests run is run here once more on real gloo groups (one
optimizer step each) and each rank's ``step_metrics`` must equal ``comm_metrics`` for its
coordinates exactly; its fp32 parameter + gradient + AdamW state must be within 10% of
``state_bytes``. The rest is pure arithmetic (``boostlr plan``, ``--search``, profiles).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from distributed import run_distributed
from parallel_cases import global_batch, layout_config
from torch.distributed.tensor import DTensor

from boostlr.analysis.costmodel import comm_metrics, state_bytes

MEMORY_TOL = 0.10


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(rank: int, world: int, cases: list[tuple[str, object]]) -> dict:
    """One optimizer step per case: this rank's ledger metrics and its resident state."""
    from boostlr.parallel.engine import ParallelModel

    out = {}
    for label, cfg in cases:
        model = ParallelModel.build(cfg, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        inputs, targets = global_batch(cfg)
        b, dp_rank = cfg.train.batch_size, model.comms.dp.rank
        mine = slice(dp_rank * b, (dp_rank + 1) * b)
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if cfg.train.dtype == "bfloat16"
            else nullcontext()
        )
        model.comms.ledger.reset()
        for _ in range(cfg.train.grad_accum):
            with autocast:
                model.forward_backward(inputs[mine], targets[mine])
        metrics = model.step_metrics()
        opt.step()
        params = model.parameters()
        state = sum(
            _local_bytes(v)
            for p in params
            for v in opt.state[p].values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        out[label] = {
            "metrics": metrics,
            "coords": (model.comms.pp.rank, model.comms.dp.rank, model.comms.tp.rank),
            "params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": state,
        }
    return out


def _case(arch: str, strategy: str, pp: int, dp: int, tp: int, **extra) -> tuple[str, object]:
    label = f"pp{pp}dp{dp}tp{tp} {arch} {strategy} {extra}"
    return label, layout_config(arch, strategy, pp, dp, tp, **extra)


CASES_2 = [  # TP 2 for every strategy and its options, dp2 and pp2 at TP 1
    _case("full", "megatron", 1, 1, 2),
    _case("full", "megatron", 1, 1, 2, **{"parallel.act_ckpt": "block"}),
    _case("cola", "vanilla", 1, 1, 2, **{"parallel.act_ckpt": "block"}),
    _case("lax", "vanilla", 1, 1, 2),
    _case("cola", "btp", 1, 1, 2, **{"parallel.act_ckpt": "lowrank"}),
    _case("svd", "btp", 1, 1, 2, **{"parallel.grouping": "false", "parallel.norm": "sync"}),
    _case("lax", "btp", 1, 1, 2, **{"parallel.act_ckpt": "block"}),
    _case("cola", "btp", 1, 1, 2, **{"train.dtype": "bfloat16"}),
    _case("full", "auto", 1, 2, 1),
    _case("lax", "auto", 2, 1, 1, **{"parallel.pp_schedule": "gpipe", "train.dtype": "bfloat16"}),
]
CASES_4 = [  # TP 4, and the 3D layouts of tests/test_parallel_3d.py
    _case("full", "megatron", 1, 1, 4),
    _case("cola", "vanilla", 1, 1, 4),
    _case("lax", "btp", 1, 1, 4, **{"parallel.act_ckpt": "lowrank"}),
    _case("cola", "vanilla", 1, 2, 2, **{"train.grad_accum": 2}),
    _case("svd", "btp", 1, 2, 2, **{"parallel.dp_mode": "ddp"}),
    _case("full", "megatron", 2, 1, 2, **{"parallel.pp_schedule": "gpipe"}),
    _case("lax", "btp", 2, 1, 2, **{"parallel.act_ckpt": "block", "train.dtype": "bfloat16"}),
    _case("cola", "btp", 2, 1, 2, **{"parallel.pp_schedule": "interleaved"}),
    _case("cola", "auto", 2, 2, 1, **{"parallel.pp_schedule": "gpipe", "parallel.microbatches": 4}),
    _case("svd", "auto", 2, 2, 1, **{"parallel.dp_mode": "ddp", "train.grad_accum": 2}),
]


@pytest.mark.parametrize("world", [2, 4])
def test_predicted_bytes_equal_the_ledger_and_memory_is_close(world: int) -> None:
    cases = CASES_2 if world == 2 else CASES_4
    per_rank = run_distributed(measure, world, cases, timeout_s=600)
    by_label = dict(cases)
    for reports in per_rank:
        for label, r in reports.items():
            cfg = by_label[label]
            pp_rank, _, tp_rank = r["coords"]
            assert r["metrics"] == comm_metrics(cfg, pp_rank, tp_rank), (label, r["coords"])
            predicted = state_bytes(cfg, pp_rank, tp_rank)
            for key in ("params", "grads", "optimizer"):
                err = abs(predicted[key] - r[key]) / r[key]
                assert err <= MEMORY_TOL, (label, r["coords"], key, predicted[key], r[key])
    # The layouts really communicate: the comparison is not between zeros.
    some = per_rank[0]
    assert any(v["metrics"]["comm_tp_bytes"] > 0 for v in some.values())
    assert any(v["metrics"]["comm_dp_bytes"] > 0 for v in some.values())
    assert any(v["metrics"]["comm_pp_bytes"] > 0 for v in some.values())
