"""Single-process trainer: run-directory contract, bitwise resume, atomic saves, divergence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from boostlr.config import RunConfig, build_config
from boostlr.errors import CheckpointError, ConfigError, TrainingDiverged
from boostlr.parallel import engine
from boostlr.rundir import checkpoint as ckpt_module
from boostlr.rundir import writer as writer_module
from boostlr.rundir.checkpoint import list_checkpoints, newest_checkpoint, open_checkpoint
from boostlr.train import run as trainer


def tiny_run_config(data: Path, **overrides: object) -> RunConfig:
    base = {
        "model.preset": "tiny",
        "model.arch": "cola",
        "data.path": str(data),
        "data.seq_len": 32,
        "data.val_batches": 2,
        "train.batch_size": 4,
        "train.steps": 6,
        "train.warmup": 2,
        "train.log_every": 1,
        "train.eval_every": 3,
        "train.ckpt_every": 3,
        "parallel.device": "cpu",
    }
    base.update({k: v for k, v in overrides.items()})
    return build_config(overrides=[(k, str(v)) for k, v in base.items()])


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rows(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def test_run_directory_contract(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = trainer.train(tiny_run_config(small_dataset), run, console=False)
    assert (run / "config.toml").is_file() and (run / "tokenizer.json").is_file()
    rows = read_rows(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert all(key in r for r in steps), key
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [3, 6]
    assert result.step == 6 and result.val_loss is not None
    saved = build_config(run / "config.toml")
    assert saved.model.vocab_size == 512 and saved.model.dim == 64


def test_resume_is_bitwise_identical(small_dataset: Path, tmp_path: Path) -> None:
    cfg = tiny_run_config(small_dataset, **{"train.grad_accum": 2})
    straight = tmp_path / "straight"
    trainer.train(cfg, straight, console=False)

    interrupted = tmp_path / "interrupted"
    trainer.train(
        tiny_run_config(small_dataset, **{"train.grad_accum": 2}), interrupted, console=False
    )
    # A run killed between step 3 and 6: the step-6 checkpoint never happened.
    shutil.rmtree(interrupted / "checkpoints" / "step_6")
    resumed_cfg = build_config(interrupted / "config.toml")
    trainer.train(resumed_cfg, interrupted, resume=True, console=False)

    expected, got = train_rows(straight), train_rows(interrupted)
    assert list(got) == [1, 2, 3, 4, 5, 6]  # rows after the checkpoint were re-logged once
    for step in (4, 5, 6):
        assert got[step] == expected[step], step  # bitwise, not approximately
    a = open_checkpoint(straight / "checkpoints" / "step_6")
    b = open_checkpoint(interrupted / "checkpoints" / "step_6")
    sa, sb = ckpt_module.load_model_state(a), ckpt_module.load_model_state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_interrupted_save_keeps_previous_checkpoint(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(small_dataset)
    calls = {"n": 0}
    real_write = writer_module._write_hashed

    def crash_on_second_save(path: Path, data: bytes) -> dict:
        calls["n"] += path.name.startswith("rng_")
        if calls["n"] == 2:  # the second save's RNG file lands, then the disk fills up
            real_write(path, data)
            raise OSError("disk full (simulated)")
        return real_write(path, data)

    monkeypatch.setattr(writer_module, "_write_hashed", crash_on_second_save)
    with pytest.raises(OSError, match="simulated"):
        trainer.train(cfg, run, console=False)
    monkeypatch.undo()
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [3]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # A hard kill leaves a temp dir and maybe a step dir without meta: both are ignored.
    (run / "checkpoints" / ".tmp-step_6-abc").mkdir()
    partial = run / "checkpoints" / "step_6"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert newest_checkpoint(run / "checkpoints").step == 3
    trainer.train(build_config(run / "config.toml"), run, resume=True, console=False)
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [3, 6]


def test_corrupted_checkpoint_is_rejected(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 3}), run, console=False)
    model_file = run / "checkpoints" / "step_3" / "__0_0.distcp"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        open_checkpoint(run / "checkpoints" / "step_3")


def test_divergence_stops_and_keeps_last_good_checkpoint(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = engine.build_stages

    def poisoned_build(*args, **kwargs):
        stages = real_build(*args, **kwargs)
        model = stages[-1].model
        real_norm = model.norm.forward  # the final norm feeds the loss on every path
        count = {"n": 0}

        def final_norm(x):
            out = real_norm(x)
            if model.training:
                count["n"] += 1
                if count["n"] == 5:
                    return out * float("nan")
            return out

        model.norm.forward = final_norm
        return stages

    monkeypatch.setattr(engine, "build_stages", poisoned_build)
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="step 5 is not finite") as info:
        trainer.train(tiny_run_config(small_dataset), run, console=False)
    assert "step_3" in str(info.value)
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [3]


def test_run_dir_guards(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(small_dataset, **{"train.steps": 3})
    with pytest.raises(CheckpointError, match="holds no run"):  # a mistyped path
        trainer.train(cfg, run, resume=True, console=False)
    trainer.train(cfg, run, console=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        trainer.train(tiny_run_config(small_dataset, **{"train.steps": 3}), run, console=False)
    other = tiny_run_config(small_dataset, **{"train.steps": 3, "model.rank": 8})
    with pytest.raises(CheckpointError, match="model config differs"):
        trainer.train(other, run, resume=True, console=False)


def test_bfloat16_autocast_trains(small_dataset: Path, tmp_path: Path) -> None:
    cfg = tiny_run_config(small_dataset, **{"train.dtype": "bfloat16", "train.steps": 3})
    result = trainer.train(cfg, tmp_path / "bf16", console=False)
    assert torch.isfinite(torch.tensor(result.loss))


def test_vocab_too_small_is_rejected(small_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="smaller than the dataset's tokenizer"):
        trainer.train(
            tiny_run_config(small_dataset, **{"model.vocab_size": 100}),
            tmp_path / "r",
            console=False,
        )
    assert not (tmp_path / "r").exists()


def test_resume_skips_a_corrupted_newest_checkpoint(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    trainer.train(tiny_run_config(small_dataset), run, console=False)
    before = train_rows(run)
    model_file = run / "checkpoints" / "step_6" / "__0_0.distcp"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    model_file.write_bytes(bytes(data))
    trainer.train(build_config(run / "config.toml"), run, resume=True, console=False)
    assert "corrupted checkpoint set aside" in capsys.readouterr().err
    assert train_rows(run) == before  # steps 4-6 re-done from step_3, bitwise the same
    assert open_checkpoint(run / "checkpoints" / "step_6").step == 6  # rewritten, valid again
    assert [r["step"] for r in read_rows(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resume_after_a_half_written_metrics_row(small_dataset: Path, tmp_path: Path) -> None:
    """A crash in the middle of a metrics write must not stop the resume."""
    run = tmp_path / "run"
    trainer.train(tiny_run_config(small_dataset), run, console=False)
    before = train_rows(run)
    shutil.rmtree(run / "checkpoints" / "step_6")  # killed after step 5's row, mid step 6's
    metrics = run / "metrics.jsonl"
    rows = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= 5]
    metrics.write_text("".join(f"{line}\n" for line in rows))
    with open(metrics, "a", encoding="utf-8") as fh:
        fh.write('{"step": 6, "loss": 4.')
    trainer.train(build_config(run / "config.toml"), run, resume=True, console=False)
    assert train_rows(run) == before  # steps 4-6 re-done from step_3, bitwise the same
    assert [r["step"] for r in read_rows(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]


STEP_KEYS = ("comm_tp_time_s", "comm_dp_time_s", "comm_pp_time_s", "compute_time_s")


def check_time_breakdown(rows: list[dict]) -> None:
    """Shared by the multi-rank tests: measured comm times fit inside the step time."""
    steps = [r for r in rows if "loss" in r]
    assert steps
    for r in steps:
        for key in (*STEP_KEYS, "peak_mem_mb"):
            assert key in r and r[key] >= 0, (key, r)
        comm = r["comm_tp_time_s"] + r["comm_dp_time_s"] + r["comm_pp_time_s"]
        assert comm <= r["step_time_s"], r
        assert r["compute_time_s"] == pytest.approx(r["step_time_s"] - comm, abs=1e-9)


def test_metrics_have_time_breakdown_memory_and_mfu(
    small_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One process: zero comm time, compute = step, RSS peak; MFU only with a known peak."""
    monkeypatch.setenv("BOOSTLR_HARDWARE", str(tmp_path / "no-profiles"))
    run = tmp_path / "run"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 2}), run, console=True)
    rows = [r for r in read_rows(run) if "loss" in r]
    check_time_breakdown(rows)
    for r in rows:
        assert r["comm_tp_time_s"] == r["comm_dp_time_s"] == r["comm_pp_time_s"] == 0
        assert r["compute_time_s"] == r["step_time_s"]
        assert r["peak_mem_mb"] > 50  # at least the interpreter and torch
        assert "mfu" not in r  # no calibrated CPU profile: omitted, not guessed
    out = capsys.readouterr().out
    assert "tok/s" in out and " MB" in out and "MFU" not in out

    # A calibrated ``local`` profile gives the peak: MFU = model FLOP/s / peak.
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    from boostlr.analysis.hardware import load_profile

    local = load_profile("a100-40gb").to_toml().replace('name = "a100-40gb"', 'name = "local"')
    local = local.replace("float32_tflops = 19.5", "float32_tflops = 0.5")
    (profiles / "local.toml").write_text(local)
    monkeypatch.setenv("BOOSTLR_HARDWARE", str(profiles))
    run = tmp_path / "run_mfu"
    trainer.train(tiny_run_config(small_dataset, **{"train.steps": 2}), run, console=True)
    rows = [r for r in read_rows(run) if "loss" in r]
    for r in rows:
        # The profile names no thread count (1 assumed): the peak scales to this process's.
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / (0.5e12 * torch.get_num_threads()))
    assert "MFU" in capsys.readouterr().out


def test_profile_steps_write_a_labelled_trace(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(small_dataset, **{"train.steps": 3, "train.profile_steps": "2:3"})
    trainer.train(cfg, run, console=False)
    trace = run / "trace_rank0_steps2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # Blocks, BTP's regions (ledger tags; TP 1 runs the grouped BTP block) and the loop.
    for label in ("block.0", "block.1", "region.qkv", "region.o_proj", "region.gate_up"):
        assert label in names, label
    for label in ("region.down_proj", "forward_backward", "optimizer.step"):
        assert label in names, label
    # Only steps 2..3: two optimizer steps, not three.
    assert sum(e.get("name") == "optimizer.step" for e in events) == 2


@pytest.mark.parametrize("spec", ["3", "0:2", "4:2", "a:b", "2:"])
def test_bad_profile_steps_are_rejected(spec: str, small_dataset: Path) -> None:
    with pytest.raises(ConfigError, match="train.profile_steps"):
        tiny_run_config(small_dataset, **{"train.profile_steps": spec})
