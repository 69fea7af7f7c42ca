"""What LaX costs beyond CoLA, counted in the code that runs and in the cost model.

On real gloo ranks at TP 2, each rank's GEMM FLOPs (torch's ``FlopCounterMode`` over one
forward + backward) and TP bytes (the ledger) of LaX minus those of CoLA must equal the
cost model's extra for the same shapes: the crossing's gate GEMMs on the replicated
``[T, r]`` latents, forward and backward, on every rank (``analysis/gemms.py``), and under
vanilla the latents' gathers. Nothing is estimated: both sides count the same shapes.
"""

from __future__ import annotations

import torch
from distributed import run_distributed
from parallel_cases import SEQ, global_batch, layout_config

from boostlr.analysis.costmodel import comm_metrics
from boostlr.analysis.gemms import backward, block_gemms

CASES = [(arch, strategy) for strategy in ("btp", "vanilla") for arch in ("cola", "lax")]
GATES = ("factored", "full")


def _config(arch: str, strategy: str, gate: str):
    return layout_config(arch, strategy, 1, 1, 2, **{"model.lax_gate": gate})


def count(rank: int, world: int, gate: str) -> dict:
    """Per case: this rank's GEMM FLOPs of one forward + backward, and its ledger metrics."""
    from torch.utils.flop_counter import FlopCounterMode

    from boostlr.parallel.engine import ParallelModel

    out = {}
    for arch, strategy in CASES:
        cfg = _config(arch, strategy, gate)
        model = ParallelModel.build(cfg, torch.device("cpu"))
        inputs, targets = global_batch(cfg)
        model.comms.ledger.reset()
        counter = FlopCounterMode(display=False)
        with counter:
            model.forward_backward(inputs, targets)
        out[(arch, strategy)] = (counter.get_total_flops(), model.step_metrics())
    return out


def _model_linear_flops(cfg) -> float:
    """The cost model's linear GEMM FLOPs of every block, forward and backward."""
    m, p = cfg.model, cfg.parallel
    total = 0.0
    for layer in range(m.n_layers):
        gemms = block_gemms(m, p.strategy_for(m.arch), p.tp, cfg.train.batch_size, SEQ, layer)
        total += sum(
            g.flops + sum(b.flops for b in backward(g)) for g in gemms if g.kind == "linear"
        )
    return total


def test_lax_extra_gemm_flops_and_bytes_per_rank_are_the_models() -> None:
    for gate in GATES:
        ranks = run_distributed(count, 2, gate, timeout_s=300)
        for strategy in ("btp", "vanilla"):
            cola, lax = _config("cola", strategy, gate), _config("lax", strategy, gate)
            want = _model_linear_flops(lax) - _model_linear_flops(cola)
            assert want > 0
            for rank, counted in enumerate(ranks):
                (f_cola, m_cola), (f_lax, m_lax) = (
                    counted["cola", strategy],
                    counted["lax", strategy],
                )
                assert f_lax - f_cola == want, (gate, strategy, rank, f_lax - f_cola, want)
                for key in m_cola:
                    extra = comm_metrics(lax, 0, rank)[key] - comm_metrics(cola, 0, rank)[key]
                    assert m_lax[key] - m_cola[key] == extra, (gate, strategy, rank, key)
