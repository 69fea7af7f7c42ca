"""``parallel.dp_mode auto``: parameters kept gathered under a pipeline, resharded without one.

How the choice is resolved and shown, and that the plan's dp traffic is the chosen mode's
(the real runs behind both pipeline modes: ``tests/test_plan_trace.py``'s pp2 x dp2 x tp2
layouts, the default and ``fsdp``).
"""

from __future__ import annotations

import pytest

from boostlr.analysis.comm import fsdp_bytes, fsdp_pipeline_bytes
from boostlr.analysis.costmodel import comm_metrics, planning_config, vocab_step_bytes
from boostlr.analysis.memory import rank_params
from boostlr.config import ParallelConfig, build_config, dump_toml
from boostlr.errors import ConfigError


def _cfg(pp: int, dp: int, *extra: tuple[str, str]):
    over = [
        ("model.preset", "1B"),
        ("data.seq_len", "1024"),
        ("train.batch_size", "4"),
        ("parallel.tp", "2"),
        ("parallel.pp", str(pp)),
        ("parallel.dp", str(dp)),
        *extra,
    ]
    return build_config(overrides=over)


@pytest.mark.parametrize(("pp", "mode"), [(1, "fsdp"), (2, "ddp"), (4, "ddp")])
def test_auto_resolves_by_the_pipeline(pp: int, mode: str) -> None:
    cfg = _cfg(pp, 2)
    assert cfg.parallel.dp_mode == mode  # resolved in place: the saved config shows it
    assert f'dp_mode = "{mode}"' in dump_toml(cfg)
    assert ParallelConfig(pp=pp, dp=2).data_parallel_mode == mode  # unresolved: the same


def test_explicit_modes_stay_and_nonsense_is_one_line() -> None:
    for pp in (1, 2):
        for mode in ("fsdp", "ddp"):
            assert _cfg(pp, 2, ("parallel.dp_mode", mode)).parallel.dp_mode == mode
    with pytest.raises(ConfigError, match=r"^parallel.dp_mode 'zero' is not one of: auto, "):
        _cfg(2, 2, ("parallel.dp_mode", "zero"))


@pytest.mark.parametrize("mode", ["auto", "fsdp", "ddp"])
def test_the_plans_dp_bytes_follow_the_mode(mode: str) -> None:
    cfg = planning_config(_cfg(2, 2, ("parallel.dp_mode", mode)))
    p, m = cfg.parallel, cfg.model
    reshard = mode == "fsdp"  # auto is ddp under the pipeline
    for pp_rank in (0, 1):
        params = rank_params(m, p.strategy_for(m.arch), p, pp_rank)
        expected = fsdp_pipeline_bytes(
            list(params.modules), p.dp, cfg.train.grad_accum, reshard, p.pp_microbatches, 4
        )
        expected += vocab_step_bytes(cfg, pp_rank)
        assert comm_metrics(cfg, pp_rank)["comm_dp_bytes"] == expected
    # Without a pipeline auto is fsdp: a gather in forward and backward, one reduction.
    flat = planning_config(_cfg(1, 2))
    params = rank_params(flat.model, "btp", flat.parallel, 0)
    expected = fsdp_bytes(list(params.modules), 2, flat.train.grad_accum, True, 4)
    assert comm_metrics(flat)["comm_dp_bytes"] == expected + vocab_step_bytes(flat)
