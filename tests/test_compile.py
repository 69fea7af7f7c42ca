"""``train.compile``: compiled blocks give eager's losses, break graphs only at collectives,
and compile once (no recompilation after the first steps).

Kept tiny: inductor's C++ build dominates (tens of seconds per graph on a cold cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_train import tiny_run_config
from tp_reference import sliced

from boostlr.cli import main
from boostlr.config import build_config
from boostlr.models.llama import build_model
from boostlr.parallel import compile as compile_module
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext

STEPS = 4  # graphs are captured in steps 1-2; steps 3-4 must reuse them
LOSS_TOL = 1e-5  # relative, fp32: inductor may reorder reductions


def _losses(
    strategy: str | None, arch: str, comm: GroupComm, compile: bool, act_ckpt: str = "none"
) -> tuple[list[float], int, dict[str, int]]:
    """Losses of a few AdamW steps; graphs captured after step 2 and graph-break reasons."""
    from torch._dynamo.utils import counters

    cfg = build_config(overrides=[("model.preset", "tiny"), ("model.arch", arch)]).model
    cfg.vocab_size = 96
    ctx = TPContext(comm, cfg, act_ckpt=act_ckpt, compile=compile)
    model = sliced(build_model(cfg, seed=0), strategy, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    counters.clear()
    losses, after_warmup = [], 0
    for step in range(STEPS):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step == 1:
            after_warmup = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    assert not compile or graphs > 0, "nothing was compiled"
    return losses, graphs - after_warmup, dict(counters["graph_break"])


def _assert_close(compiled: list[float], eager: list[float]) -> None:
    for c, e in zip(compiled, eager, strict=True):
        assert abs(c - e) <= LOSS_TOL * abs(e), (compiled, eager)


@pytest.mark.parametrize(("arch", "act_ckpt"), [("cola", "lowrank"), ("full", "block")])
def test_compiled_tp1_matches_eager_without_graph_breaks(arch: str, act_ckpt: str) -> None:
    """One process: each block (BTP's grouped block for cola) is a single graph."""
    single = GroupComm(None, "tp", CommLedger())
    eager, _, _ = _losses(None, arch, single, compile=False, act_ckpt=act_ckpt)
    compiled, recompiled, breaks = _losses(None, arch, single, compile=True, act_ckpt=act_ckpt)
    _assert_close(compiled, eager)
    assert recompiled == 0
    assert breaks == {}


def _tp2_case(rank: int, world_size: int, strategy: str, arch: str) -> tuple:
    comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
    eager, _, _ = _losses(strategy, arch, comm, compile=False)
    compiled, recompiled, breaks = _losses(strategy, arch, comm, compile=True)
    return eager, compiled, recompiled, breaks


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "arch"), [("btp", "cola"), ("megatron", "full")])
def test_compiled_tp2_breaks_graphs_only_at_collectives(strategy: str, arch: str) -> None:
    for eager, compiled, recompiled, breaks in run_distributed(
        _tp2_case, 2, strategy, arch, timeout_s=900
    ):
        _assert_close(compiled, eager)
        assert recompiled == 0
        assert breaks, "the collectives between regions must stay outside the graphs"
        for reason in breaks:  # every break is a disabled collective entry point
            assert "torch.compiler.disable" in reason or "skip" in reason.lower(), reason
            assert "_eager" in reason or "all_reduce_" in reason, reason


def test_missing_cxx_compiler_exits_2(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch._inductor.config as inductor_config

    # torch's own patch(), not monkeypatch: pytest >= 9.2 undoes a setattr on an object
    # without the name in its __dict__ (``config.cpp`` is a proxy) by *deleting* it, which
    # hides ``cpp.cxx`` from every later compile in this process.
    cxx = inductor_config.cpp.cxx
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--model.preset", "tiny", "--train.compile", "true"]
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}):
        code = main([*args, "--data.path", str(small_dataset), "--parallel.device", "cpu"])
    assert inductor_config.cpp.cxx == cxx
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a C++ compiler" in err[0], err
    assert not run.exists()


def test_trainer_compiles_and_logs_like_eager(small_dataset: Path, tmp_path: Path) -> None:
    """``--train.compile true`` end to end: the same losses as eager, a loss row per step."""
    from test_train import train_rows

    from boostlr.train import run as trainer

    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 3}), eager, console=False)
    cfg = tiny_run_config(small_dataset, **{"train.steps": 3, "train.compile": True})
    trainer.train(cfg, compiled, console=False)
    a, b = train_rows(eager), train_rows(compiled)
    assert a.keys() == b.keys()
    _assert_close(list(b.values()), list(a.values()))
    assert compile_module._COMPILED  # the trainer did go through torch.compile
