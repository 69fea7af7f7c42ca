"""The cost model against what runs: ledger bytes, parameter memory, plan's contract.

Every layout the TP and 3D tests run is run here once more on real gloo groups (one
optimizer step each) and each rank's ``step_metrics`` must equal ``comm_metrics`` for its
coordinates exactly; its fp32 parameter + gradient + AdamW state must be within 10% of
``state_bytes``. The rest is pure arithmetic (``boostlr plan``, ``--search``, profiles).
"""

from __future__ import annotations

import json
import resource
from dataclasses import replace

import pytest
import torch
from distributed import run_distributed
from parallel_cases import layout_config, resident_bytes, step_once

from boostlr.analysis.costmodel import comm_metrics, predict, state_bytes
from boostlr.analysis.hardware import Link, load_profile
from boostlr.cli import main
from boostlr.config import build_config
from boostlr.errors import ConfigError

MEMORY_TOL = 0.10


def measure(rank: int, world: int, cases: list[tuple[str, object]]) -> dict:
    """One optimizer step per case: this rank's ledger metrics and its resident state."""
    out = {}
    for label, cfg in cases:
        model, opt = step_once(cfg)
        metrics = model.step_metrics()
        opt.step()
        out[label] = {
            "metrics": metrics,
            "coords": (model.comms.pp.rank, model.comms.dp.rank, model.comms.tp.rank),
            **resident_bytes(model, opt),
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


# --- boostlr plan: pure arithmetic --------------------------------------------------------

PAPER_7B = [
    "--model.preset",
    "7B",
    "--data.seq_len",
    "4096",
    "--train.batch_size",
    "4",
    "--train.dtype",
    "bfloat16",
    "--parallel.tp",
    "4",
    "--parallel.act_ckpt",
    "lowrank",
]
ROW_KEYS = {
    "arch": str,
    "strategy": str,
    "step_time_s": float,
    "compute_s": float,
    "comm_s": float,
    "tp_bytes_fwd_per_block": int,
    "memory_gb": float,
    "fits": bool,
}


def _plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(["--hardware", "a100-40gb", "--json", *PAPER_7B], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {"rows", "hardware", "layout"}
    rows = data["rows"]
    assert [(r["arch"], r["strategy"]) for r in rows] == [
        ("full", "megatron"),
        ("cola", "vanilla"),
        ("cola", "btp"),
    ]
    for r in rows:
        for key, kind in ROW_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["step_time_s"] == pytest.approx(r["compute_s"] + r["comm_s"] + r["bubble_s"])
        assert r["fits"] == (r["memory_gb"] <= data["hardware"]["memory"] / 1e9)
    assert data["layout"]["tp"] == 4 and data["hardware"]["name"] == "a100-40gb"
    # docs/design.md §2's per-block forward figures for LLaMA-7B, batch 4, bf16 (GiB).
    gib = [r["tp_bytes_fwd_per_block"] / 2**30 for r in rows]
    assert round(gib[0], 2) == 0.25 and round(gib[2], 2) == 0.22 and abs(gib[1] - 1.32) < 0.03
    full, vanilla, btp = (r["step_time_s"] for r in rows)
    assert btp < full < vanilla  # the paper's ordering at 7B / TP 4
    assert rows[1]["gemm_intensity_min"] < rows[2]["gemm_intensity_min"]  # skinny vanilla B


def test_plan_table_and_meta_only(capsys: pytest.CaptureFixture[str]) -> None:
    """30B planned on a profile; the process does not grow by anything like its weights."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    code, out, _ = _plan(
        ["--hardware", "h200", "--model.preset", "30B", "--parallel.tp", "4", "--parallel.pp", "4"],
        capsys,
    )
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert code == 0 and "btp" in out and "megatron" in out
    assert grown < 1e9  # 30B fp32 weights alone would be 130 GB


def test_search_proposes_only_valid_layouts_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    hw = load_profile("a100-40gb")
    args = ["--hardware", "a100-40gb", "--search", "--gpus", "16", "--json", "--top", "8"]
    base = ["--model.preset", "13B", "--data.seq_len", "4096", "--train.batch_size", "8"]
    base += ["--train.dtype", "bfloat16", "--train.global_batch", "128"]
    code, out, _ = _plan(args + base, capsys)
    assert code == 0
    rows = json.loads(out)["rows"]
    assert rows and rows == sorted(rows, key=lambda r: r["step_time_s"])
    pairs = list(zip(base[::2], base[1::2], strict=True))
    for r in rows:
        over = [(k, v) for k, v in r["overrides"].items()]
        cfg = build_config(overrides=[(k.removeprefix("--"), v) for k, v in pairs] + over)
        p = cfg.parallel
        assert p.world_size == 16 and p.tp <= hw.gpus_per_node
        assert cfg.train.batch_size * cfg.train.grad_accum * p.dp == 128
        assert r["fits"] and r["memory_gb"] * 1e9 <= hw.memory
        assert predict(cfg, hw).step_time == pytest.approx(r["step_time_s"])
    # 13B fp32 state alone (16 bytes/param = 208 GB) cannot sit on one 40 GB GPU: never
    # proposed at pp 1 x tp 1 x dp 1 on fewer GPUs, and 1 GPU is refused outright.
    code, _, err = _plan(["--hardware", "a100-40gb", "--search", "--gpus", "1", *base], capsys)
    assert code == 2 and "does not fit any" in err


def test_search_fits_the_papers_7b_btp_layout_in_40_gb(capsys: pytest.CaptureFixture[str]) -> None:
    """The BOOST paper trained 7B CoLA under BTP on 4 A100-40GB at its global batch (4
    sequences of 4096 tokens, one per micro-batch): ``--search`` must find such a layout."""
    args = ["--hardware", "a100-40gb", "--search", "--gpus", "4", "--json", "--top", "20"]
    paper = ["--model.preset", "7B", "--model.arch", "cola", "--model.vocab_size", "32000"]
    paper += ["--data.seq_len", "4096", "--train.dtype", "bfloat16"]
    paper += ["--train.batch_size", "1", "--train.global_batch", "4"]
    code, out, _ = _plan(args + paper, capsys)
    assert code == 0
    rows = json.loads(out)["rows"]
    btp = [r for r in rows if r["strategy"] == "btp"]
    assert btp and all(r["fits"] and r["memory_gb"] <= 40.0 for r in btp)
    assert all(r["layout"]["global_batch"] == 4 for r in rows)
    tp4 = [r for r in btp if r["layout"]["tp"] == 4]  # the paper's layout: tp4, 1 x 4
    assert tp4 and tp4[0]["layout"]["grad_accum"] == 4 and tp4[0]["layout"]["dp"] == 1


def test_the_btp_speed_up_column_says_what_it_divides_by(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Plain plan: by the btp row; --search: by the first (fastest) btp layout listed, or a
    dash when none is listed."""
    paper = ["--hardware", "a100-40gb", "--model.preset", "7B", "--model.arch", "cola"]
    paper += ["--data.seq_len", "4096", "--train.dtype", "bfloat16"]
    paper += ["--train.batch_size", "1", "--train.global_batch", "4"]
    for extra, says in [
        ([], "the step s of the btp row,"),
        (["--gpus", "4", "--search", "--top", "20"], "the step s of the first btp row (row "),
        (["--gpus", "4", "--search", "--top", "1", "--parallel.tp_strategy", "vanilla"], None),
    ]:
        code, out, _ = _plan(paper + extra, capsys)
        text = " ".join(out.split())
        assert code == 0 and "btp speed-up over row" in text
        if says is not None:
            assert f"btp speed-up over row: the row's step s / {says}" in text, text[-400:]
        elif "│ btp " not in out:
            assert "no btp row listed to divide by" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hardware", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
        (["--hardware", "a100-40gb", "--search"], "--search needs --gpus"),
        (["--hardware", "a100-40gb", "--search", "--gpus", "6"], "not a multiple of the 4"),
        (["--hardware", "a100-40gb", "--parallel.tp", "3"], "parallel.tp 3 does not divide"),
        (["--hardware", "a100-40gb", "--model.nope", "1"], "unknown config key 'model.nope'"),
        (["--hardware", "/nonexistent/hw.toml"], "does not exist"),
    ],
)
def test_bad_plan_requests_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _plan(args, capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_profiles_load_and_user_profiles_win(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200"):
        hw = load_profile(name)
        assert hw.name == name and hw.memory > 30e9 and hw.flops("bfloat16") > 1e14
    a100 = load_profile("a100-40gb")
    assert a100.gpus_per_node == 4 and a100.flops("bfloat16") == 312e12
    monkeypatch.setenv("BOOSTLR_HARDWARE", str(tmp_path))
    mine = replace(
        a100,
        name="local",
        memory=1e9,
        gpus_per_node=2,
        device="cpu",
        attention_efficiency=0.3,
        launch=8e-6,  # a value that survives the µs round trip exactly
        host_op=16e-6,
        intra=Link(300e9, 8e-6, 8e-6),
        inter=Link(25e9, 8e-6, 8e-6),
    )
    (tmp_path / "local.toml").write_text(mine.to_toml())
    assert load_profile("local") == replace(mine, extra={})
    (tmp_path / "tpu.toml").write_text(mine.to_toml().replace('"cpu"', '"tpu"'))
    with pytest.raises(ConfigError, match="device must be gpu or cpu"):
        load_profile("tpu")
    code, out, _ = _plan(["--hardware", "local", "--json", "--model.preset", "7B"], capsys)
    assert code == 0 and not any(r["fits"] for r in json.loads(out)["rows"])  # 1 GB


def test_profiles_hold_the_cards_capacity_in_mib(tmp_path) -> None:
    """A data sheet's "40 GB" is 40 GiB: each shipped profile is nvidia-smi's total in MiB
    (not 40e9 bytes, 7% short); a user file's ``memory_gb`` still reads as 1e9 bytes."""
    mib = {"a100-40gb": 40960, "a100-80gb": 81920, "h100-sxm": 81559, "h200": 143771}
    for name, total in mib.items():
        assert load_profile(name).memory == total * 2**20
    assert load_profile("a100-40gb").memory == 40 * 2**30
    text = load_profile("a100-40gb").to_toml()
    assert "memory_gb = 42.94967296" in text  # written back in the old unit, exactly
    (tmp_path / "gb.toml").write_text(text.replace("42.94967296", "40.0"))
    assert load_profile(str(tmp_path / "gb.toml")).memory == 40e9
    (tmp_path / "none.toml").write_text(text.replace("memory_gb = 42.94967296\n", ""))
    with pytest.raises(ConfigError, match="memory_mib"):
        load_profile(str(tmp_path / "none.toml"))


# --- boostlr plan --plot -------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plan_plot_writes_a_png_without_allocating(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The three panels for a small config; the weak-scaling panel plans up to 30B."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    code, stdout, _ = _plan(
        ["--hardware", "a100-40gb", "--model.preset", "small", "--plot", str(out)], capsys
    )
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert code == 0 and f"wrote {out}" in stdout and "btp" in stdout
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 30_000  # three panels, not a blank page
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 2 * height > 600
    assert grown < 1e9  # 30B fp32 weights alone would be 130 GB


def test_plot_points_are_the_searchs_best_layouts() -> None:
    """Each scaling point is ``--search``'s fastest layout for its line, on its GPU count,
    with the curve's one global batch; weak-scaling points hold their sequences per GPU."""
    from boostlr.analysis import plan
    from boostlr.plots.plan import plot_data

    hw = load_profile("a100-40gb")
    cfg = build_config(overrides=[("model.preset", "small"), ("train.batch_size", "4")])
    data = plot_data(cfg, hw, gpu_counts=(1, 4, 16), weak=(("1B", 1), ("7B", 4)))
    sc = data["scaling"]
    assert sc["global_batch"] == 64  # 16 sequences rounded up to 16 GPUs x batch_size 4
    for i, n in enumerate(sc["gpus"]):
        points = {s: pts[i] for s, pts in sc["points"].items()}
        assert all(p is not None for p in points.values()), (n, points)
        for s, p in points.items():
            assert p["layout"]["gpus"] == n and p["layout"]["global_batch"] == 64
            assert p["strategy"] in (None, s)
        base = plan.search_form(cfg, n, 64)
        best = plan.search(base, hw, n, top=1)[0].prediction.step_time
        lowrank = min(points["vanilla"]["step_time_s"], points["btp"]["step_time_s"])
        assert lowrank == pytest.approx(best)
        dense = plan.search(plan.variant(base, "full", "auto", "none"), hw, n, top=1)[0]
        assert points["megatron"]["step_time_s"] == pytest.approx(dense.prediction.step_time)
    assert data["weak"]["sequences_per_gpu"] == 4
    for row in data["weak"]["rows"]:
        for s in ("megatron", "vanilla", "btp"):
            lay = row[s]["layout"]
            assert lay["gpus"] == row["gpus"] and lay["global_batch"] == 4 * row["gpus"]
    assert [b["line"] for b in data["breakdown"]] == ["megatron", "vanilla", "btp"]


def test_plot_without_matplotlib_exits_2(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "plan.png"
    code, stdout, err = _plan(["--hardware", "a100-40gb", "--plot", str(out)], capsys)
    assert code == 2 and stdout == "" and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "pip install 'boostlr[plot]'" in err


# --- the optimizer step, counted in torch's own implementation ----------------------------


class _Traffic:
    """Bytes each dispatched op reads (every tensor operand) and writes (mutated operands and
    new results), over tensors of at least ``n`` elements (the parameter, not the scalars)."""

    def __init__(self, n: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                read = written = 0
                operands: list[torch.Tensor] = []
                schema = func._schema.arguments
                bound = list(zip(schema, args, strict=False))
                bound += [(a, kwargs[a.name]) for a in schema if a.name in kwargs]
                for arg, value in bound:
                    tensors = [t for t in tree_leaves(value) if torch.is_tensor(t)]
                    big = [t for t in tensors if t.numel() >= n]
                    operands += big
                    read += sum(t.numel() * t.element_size() for t in big)
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        written += sum(t.numel() * t.element_size() for t in big)
                for t in tree_leaves(out):
                    fresh = not any(t is u for u in operands)
                    if torch.is_tensor(t) and t.numel() >= n and fresh:
                        written += t.numel() * t.element_size()
                if read or written:
                    counter.ops.append(str(func))
                    counter.bytes += read + written
                return out

        self.mode, self.ops, self.bytes = Mode(), [], 0


def test_optimizer_passes_are_torchs() -> None:
    """The cost model's clipping passes and its one fused AdamW kernel are what torch
    dispatches: the same number of ops and the same operand bytes per element."""
    from boostlr.analysis.costmodel import CLIP_PASSES
    from boostlr.config import TrainConfig
    from boostlr.train.optim import build_optimizer

    n = 4096
    p = torch.nn.Parameter(torch.randn(n, 2))
    p.grad = torch.randn(n, 2)
    opt = build_optimizer([p], TrainConfig())  # the trainer's optimizer
    opt.step()  # state exists: the step below is a steady-state one
    n = 2 * n
    traffic = _Traffic(n)
    with traffic.mode:
        opt.step()
    assert [op for op in traffic.ops if "adam" in op] == ["aten._fused_adamw_.default"]
    traffic = _Traffic(n)
    with traffic.mode:  # what ParallelModel.clip_gradients runs on plain tensors
        norm = torch.nn.utils.get_total_norm([p.grad], 2.0)
        torch.nn.utils.clip_grads_with_norm_([p], 1.0, norm)
    assert len(traffic.ops) == len(CLIP_PASSES), traffic.ops
    assert traffic.bytes == sum(CLIP_PASSES) * n


# --- boostlr calibrate's fits ---------------------------------------------------------------


def test_calibrate_fits_recover_the_constants_they_were_made_with() -> None:
    """The GEMM curve and the link come back from timings made with known constants."""
    from boostlr.calibrate import GEMM_SHAPES, fit_allreduce, fit_gemm

    peak, eff, half, bw, launch = 300e12, 0.8, 128.0, 2e12, 5e-6

    def seconds(m: int, k: int, n: int) -> float:
        shape = (m / (m + half)) * (k / (k + half)) * (n / (n + half))
        compute = 2 * m * k * n / (peak * eff * shape)
        return max(compute, (m * k + k * n + m * n) * 2 / bw) + launch

    samples = [(m, k, n, seconds(m, k, n)) for m, k, n in GEMM_SHAPES]
    best, e, h = fit_gemm(samples, bw, launch, 2)
    for m, k, n, t in samples:  # the fitted roofline reproduces every timing
        shape = (m / (m + h)) * (k / (k + h)) * (n / (n + h))
        fitted = max(2 * m * k * n / (best * e * shape), (m * k + k * n + m * n) * 2 / bw)
        assert fitted + launch == pytest.approx(t, rel=0.05), (m, k, n)
    alpha, link_bw = 20e-6, 50e9
    link = fit_allreduce(
        [(n, 2 * (alpha + launch) + n / link_bw) for n in (2**16, 2**20, 2**24)], launch
    )
    assert link.latency == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth == pytest.approx(link_bw, rel=1e-6)


def test_calibrate_procs_was_removed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--procs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--procs was removed" in err[0]
