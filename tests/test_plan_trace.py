"""``plan --trace`` held to real runs: the same config on real gloo ranks, torch's FSDP
collectives (the gloo-only in-place path off), measured by the same per-storage counter.

Every collective of the second step (order, op, group, phase, bytes) must equal the traced
rank's exactly, and each traced rank's peak tensor bytes must be within 5% of the real one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from distributed import run_distributed
from parallel_cases import VOCAB, layout_config

from boostlr.analysis.costmodel import comm_metrics
from boostlr.config import build_config
from boostlr.trace import fake_world
from boostlr.trace.counter import StorageCounter, allocator_size, counting
from boostlr.trace.rank import RankTrace, coordinates
from boostlr.trace.run import trace_here, traced_ranks

LAYOUTS = {  # (pp, dp, tp, extra overrides)
    "pp2xdp2xtp2": (2, 2, 2, {}),  # dp_mode auto: ddp under the pipeline
    # FSDP resharded after every pipeline micro-batch (the other dp_mode under a pipeline)
    "pp2xdp2xtp2-fsdp": (2, 2, 2, {"parallel.dp_mode": "fsdp"}),
    "tp2": (1, 1, 2, {}),
    "dp2": (1, 2, 1, {}),
    "pp2": (2, 1, 1, {}),
    # bf16 autocast (its weight-cast cache) and FSDP's mixed precision, two micro-batches
    "dp2xtp2-bf16": (1, 2, 2, {"train.dtype": "bfloat16", "train.grad_accum": 2}),
    # more micro-batches than a trace runs: the real rank runs all 4, the trace 2 (+ repeats)
    "tp2-accum4": (1, 1, 2, {"train.grad_accum": 4}),
    "pp2xdp2-accum3": (2, 2, 1, {"train.grad_accum": 3}),
}


def _cfg(pp: int, dp: int, tp: int, extra: dict | None = None):
    return layout_config("cola", "btp" if tp > 1 else "auto", pp, dp, tp, **(extra or {}))


def _real_then_traced(rank: int, world: int, cfg) -> tuple[dict, dict | None]:
    """Two real steps on gloo, counted as the trace counts them; then, if ``rank`` is one
    ``plan --trace`` traces, the same rank again in a fake world (the process's gloo group
    is closed first: a fake world needs the default group). ``plan --trace`` itself gives
    each rank a fresh process: ``test_plan_trace_json_has_the_documented_fields``."""
    import torch.distributed as dist

    from boostlr.parallel.mesh import build_mesh
    from boostlr.trace.rank import two_steps

    comms = build_mesh(cfg.parallel, torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    shape = (cfg.train.batch_size, cfg.data.seq_len)

    def batch(step: int, micro: int):
        return torch.randint(0, VOCAB, shape, generator=gen), torch.randint(
            0, VOCAB, shape, generator=gen
        )

    counter = StorageCounter()
    with counting(counter):
        real = two_steps(cfg, comms, counter, rank, batch).as_dict()
    del comms
    dist.barrier()
    dist.destroy_process_group()
    traced = trace_here(cfg, rank).as_dict() if rank in traced_ranks(cfg) else None
    return real, traced


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trace_matches_real_gloo_run(name: str) -> None:
    cfg = _cfg(*LAYOUTS[name])
    results = run_distributed(_real_then_traced, cfg.parallel.world_size, cfg, timeout_s=240)
    ranks = traced_ranks(cfg)
    assert 0 in ranks and len({coordinates(cfg, r)[0] for r in ranks}) == cfg.parallel.pp
    for rank in ranks:
        truth, fake = (RankTrace(**d) for d in results[rank])
        print(f"{name} rank {rank}: peak traced {fake.peak_bytes} real {truth.peak_bytes}")
        assert fake.records == truth.records, f"{name} rank {rank}: collectives differ"
        assert fake.records or cfg.parallel.world_size == 1
        assert fake.steps_equal and truth.steps_equal
        assert abs(fake.peak_bytes - truth.peak_bytes) <= 0.05 * truth.peak_bytes, (
            f"{name} rank {rank}: traced peak {fake.peak_bytes} vs real {truth.peak_bytes} "
            f"(phases {fake.peaks} vs {truth.peaks})"
        )
        if cfg.train.dtype == "float32":  # bf16: the plan counts BTP's last-hidden gather
            # in fp32, the code sends it in bf16 (benchmarks/RESULTS.md, plan --trace)
            plan = comm_metrics(cfg, fake.pp_stage, fake.tp_rank)
            planned = {g: plan[f"comm_{g}_bytes"] for g in ("tp", "dp", "pp")}
            assert fake.comm_bytes() == planned, f"{name} rank {rank}: plan's bytes differ"


BLOCK_CASES = {  # config overrides: each strategy, with and without recompute, under bf16
    "full-none": {"model.arch": "full", "parallel.tp_strategy": "megatron"},
    "vanilla-block": {"parallel.tp_strategy": "vanilla", "parallel.act_ckpt": "block"},
    "btp-lowrank": {"parallel.tp_strategy": "btp", "parallel.act_ckpt": "lowrank"},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_plans_bytes_per_block_are_the_traced_ones(name: str) -> None:
    """What one more block adds to a rank's peak (its state, the bf16 weight copies its
    GEMMs keep, the activations it saves) is the plan's, within 1%; the whole peak within
    10% (at this width the head and loss weigh more than at paper scale). Two depths of the
    same bf16 tp2 layout, two micro-batches (gradients held)."""
    from boostlr.analysis.costmodel import memory_breakdown
    from boostlr.analysis.hardware import load_profile
    from boostlr.analysis.plan import load_config
    from boostlr.config import parse_overrides
    from boostlr.trace.run import trace_rank

    hw = load_profile("a100-40gb")
    base = {"model.preset": "small", "model.vocab_size": "512", "data.seq_len": "256",
            "train.dtype": "bfloat16", "train.batch_size": "1", "train.global_batch": "2",
            "parallel.tp": "2", **BLOCK_CASES[name]}  # fmt: skip
    traced, planned = {}, {}
    for layers in (2, 4):
        args = [f"--{k}={v}" for k, v in {**base, "model.n_layers": layers}.items()]
        cfg = load_config(None, parse_overrides(args), 2, False)
        traced[layers] = trace_rank(cfg, 0).peak_bytes
        plan = memory_breakdown(cfg, hw, 0)
        planned[layers] = sum(v for k, v in plan.items() if k != "reserved")
        assert planned[layers] == pytest.approx(traced[layers], rel=0.1), name
    per_block = (traced[4] - traced[2]) / 2
    assert (planned[4] - planned[2]) / 2 == pytest.approx(per_block, rel=0.01), name


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 1, 2), (2, 1, 1)])
def test_a_trace_running_two_micro_batches_reports_the_whole_step(pp, dp, tp) -> None:
    """A step of 5 micro-batches traced with 2 (the rest repeated in the ledger) reports
    what running all 5 reports: the same peaks per phase and the same collectives."""
    cfg = _cfg(pp, dp, tp, {"train.grad_accum": 5})
    whole, capped = trace_here(cfg, 0, micro_limit=None), trace_here(cfg, 0)
    assert (whole.micro_run, capped.micro_run) == (5, 2)
    assert capped.records == whole.records and whole.records
    assert capped.peaks == whole.peaks and capped.held_after == whole.held_after
    assert capped.steps_equal and whole.steps_equal


def test_traced_ranks_cover_every_role() -> None:
    cfg = _cfg(2, 2, 2)  # VOCAB 101 does not split evenly over dp x tp = 4
    assert traced_ranks(cfg) == [0, 3, 4, 7]
    cfg.model.vocab_size = 128
    assert traced_ranks(cfg) == [0, 4]


# ----------------------------------------------------------------------------- the counter


def test_counter_counts_each_storage_once_and_its_resizes() -> None:
    counter = StorageCounter()
    with counting(counter):
        counter.phase("a")
        x = torch.empty(1000)  # 4000 bytes
        view = x.view(10, 100)
        y = x + 1
        assert counter.current == 8000
        del y
        assert counter.current == 4000
        x.untyped_storage().resize_(0)  # as FSDP frees a gathered parameter
        assert counter.current == 0
        x.untyped_storage().resize_(4000)
        assert counter.current == 4000
        del x, view
        assert counter.current == 0
    assert counter.peaks["a"] == 8000
    assert allocator_size(1) == 512 and allocator_size(10 << 20) == 10 << 20
    assert allocator_size((10 << 20) + 1) == (10 << 20) + 512  # the 2 MiB tail is split off
    assert allocator_size((11 << 20) + 1) == 12 << 20  # a tail under 1 MiB is not


# ----------------------------------------------------------------------------- torch internals


def test_torch_private_pieces_still_behave() -> None:
    """Each torch-private piece fake_world relies on exists and does what it assumes."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    assert callable(schedules._PipelineSchedule._warmup_p2p)
    assert callable(InferenceMode.needs_dynamic) and InferenceMode.STATIC
    assert callable(ShardingPropagator._propagate_tensor_meta_non_cached)
    assert fake_world.mutates(torch.ops.aten.add_.Tensor)
    assert not fake_world.mutates(torch.ops.aten.add.Tensor)
    x = torch.empty(4)
    assert fake_world.storage_key(x.untyped_storage()) == fake_world.storage_key(
        x[1:].untyped_storage()
    )
    assert not fake_world.in_backward()
    with fake_world.fake_tensors() as mode:
        counter = StorageCounter(mode)
        with counting(counter):
            t = torch.empty(256, 4)
            assert fake_world.is_fake(t) and fake_world.fake_mode_of(t) is mode
            assert counter.current == 4096
            t.untyped_storage().resize_(0)
            assert counter.current == 0
    # A fake world of 64 ranks in a fresh interpreter: groups, mesh and a collective.
    code = (
        "import torch, torch.distributed as dist\n"
        "from boostlr.trace.fake_world import init_fake_world\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "init_fake_world(37, 64)\n"
        "m = init_device_mesh('cpu', (4, 4, 4), mesh_dim_names=('pp', 'dp', 'tp'))\n"
        "t = torch.ones(3); dist.all_reduce(t, group=m.get_group('dp'))\n"
        "print(dist.get_backend(), m['tp'].get_local_rank(), dist.get_world_size())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fake", "1", "64"]


def test_plan_trace_json_has_the_documented_fields(tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "boostlr.cli", "plan", "--hardware", "h100-sxm", "--gpus", "2",
        "--trace", "--json", "--model.preset", "tiny", "--data.seq_len", "16",
        "--train.batch_size", "2", "--parallel.tp", "2", "--parallel.dp", "1",
        "--trace-rank", "1",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    entries = json.loads(out.stdout)["trace"]
    assert [(e["rank"], e["tp_rank"]) for e in entries] == [(1, 1)]  # the one asked for
    e = entries[0]
    assert e["wall_s"] > 0
    for key in ("rank", "pp_stage", "peak_bytes", "plan_peak_bytes"):
        assert isinstance(e[key], int)
    for key in ("comm_bytes", "plan_comm_bytes"):
        assert set(e[key]) == {"tp", "dp", "pp"}
    assert e["comm_bytes"] == e["plan_comm_bytes"] and e["comm_bytes"]["tp"] > 0
    # the ordered ledger: every record once, its groups' bytes adding up to comm_bytes
    by_group = dict.fromkeys(("tp", "dp", "pp"), 0)
    for r in e["schedule"]:
        by_group[r["group"]] += r["bytes"]
    assert by_group == e["comm_bytes"]
    assert [r["phase"] for r in e["schedule"]][0] == "fwd"
    assert 0 < e["peak_bytes"] <= e["device_bytes"]


def test_ranks_traced_side_by_side_equal_ranks_traced_one_by_one() -> None:
    """``--trace-jobs``: the ranks' processes are independent, so running them at once
    changes nothing they report, and the results come back in rank order."""
    from boostlr.trace.run import trace

    cfg = build_config(
        overrides=[
            ("model.preset", "tiny"),
            ("data.seq_len", "16"),
            ("train.batch_size", "2"),
            ("parallel.pp", "2"),
            ("parallel.tp", "2"),
            ("parallel.nproc", "4"),
        ]
    )
    one_by_one, side_by_side = trace(cfg, jobs=1), trace(cfg, jobs=2)
    assert [t.rank for t in side_by_side] == [t.rank for t in one_by_one] == [0, 2]
    for a, b in zip(one_by_one, side_by_side, strict=True):
        assert (a.peak_bytes, a.comm_bytes()) == (b.peak_bytes, b.comm_bytes())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace-rank", "0"], "add --trace"),
        (["--trace", "--trace-rank", "2"], "--trace-rank 2 is not a rank of a world of 2"),
        (["--trace-jobs", "2"], "with --trace"),
        (["--trace", "--trace-jobs", "0"], "N >= 1"),
    ],
)
def test_trace_rank_is_checked(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from boostlr.cli import main

    base = ["plan", "--hardware", "h100-sxm", "--gpus", "2", "--model.preset", "tiny"]
    code = main([*base, "--parallel.tp", "2", "--parallel.dp", "1", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
