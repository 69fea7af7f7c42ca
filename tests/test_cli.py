"""The ``boostlr`` command line as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from boostlr.cli import main, split_overrides


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def tiny_args(data: Path, run: Path, steps: int = 2) -> list[str]:
    return [
        "train",
        "--run-dir",
        str(run),
        "--quiet",
        "--model.preset",
        "tiny",
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--train.batch_size",
        "2",
        f"--train.steps={steps}",
        "--parallel.device",
        "cpu",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--model.arch", "dense"], "model.arch 'dense' is not one of"),
        (["train", "--model.nope", "1"], "unknown config key 'model.nope'"),
        (["train", "--train.steps", "x"], "train.steps: expected int"),
        (["train", "missing.toml"], "does not exist"),
        (["train", "--resume"], "--resume needs --run-dir"),
        (["train", "--data.path", "/nonexistent/ds"], "/nonexistent/ds"),
        (["export", "/nonexistent/ckpt", "--out", "{tmp}/out"], "not a checkpoint"),
        (["ckpt", "info", "/nonexistent/ckpt"], "/nonexistent/ckpt does not exist"),
        (["prepare", "--input", "/nonexistent/in", "--out", "{tmp}/out"], "/nonexistent/in"),
        (["generate", "/nonexistent/p", "--prompt", "x"], "/nonexistent/p"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]  # never a shared path like /tmp/x
    code, _, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("boostlr: error:") and message in lines[0]


def test_prepare_of_blank_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blank = tmp_path / "blank.txt"
    blank.write_text("\n")
    code, _, err = run_cli(
        ["prepare", "--input", str(blank), "--out", str(tmp_path / "ds")], capsys
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "contains no text" in lines[0], err
    assert str(blank) in lines[0] and "pass files with text" in lines[0]
    assert not (tmp_path / "ds").exists()


def test_split_overrides_keeps_paths_with_dots() -> None:
    rest, overrides = split_overrides(["train", "a.toml", "--run-dir", "r.x", "--model.rank=4"])
    assert rest == ["train", "a.toml", "--run-dir", "r.x"] and overrides == ["--model.rank=4"]


def test_train_export_generate_round_trip(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert run_cli(tiny_args(small_dataset, run), capsys)[0] == 0
    assert run_cli(tiny_args(small_dataset, run), capsys)[0] == 2  # run dir already used
    code, _, _ = run_cli(
        ["train", "--run-dir", str(run), "--resume", "--quiet", "--train.steps", "3"], capsys
    )
    assert code == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 3
    export = tmp_path / "export"
    assert run_cli(["export", str(run), "--out", str(export)], capsys)[0] == 0
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {
        p.name for p in export.iterdir()
    }
    code, out, _ = run_cli(
        [
            "generate",
            str(export),
            "--prompt",
            "def ",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
        ],
        capsys,
    )
    assert code == 0 and out.startswith("def ")


def test_console_script_prepare(tmp_path: Path) -> None:
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.txt").write_text("hello world, " * 200)
    (src / "b.md").write_text("# title\nsome markdown text " * 100)
    out = tmp_path / "ds"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "boostlr.cli",
            "prepare",
            "--input",
            str(src),
            "--out",
            str(out),
            "--tokenizer",
            "bpe:300",
            "--val-fraction",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "manifest.json").is_file() and "train" in proc.stdout
    again = subprocess.run(
        [sys.executable, "-m", "boostlr.cli", "prepare", "--input", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_train_says_what_it_trains_and_what_mem_floor_means(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the first step: arch, size, device, layout, data, run dir, and the legend of
    the step lines' ``mem … / floor …``; ``--quiet`` prints none of it."""
    run = tmp_path / "run"
    args = [a for a in tiny_args(small_dataset, run) if a != "--quiet"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    lines = out.splitlines()
    first, data, legend = lines[:3]
    assert first.startswith("training cola rank ") and "(tiny preset, " in first
    assert "M parameters) on cpu, pp1 x dp1 x tp1 (1 rank), float32" in first
    assert data.startswith(f"data {small_dataset} (vocabulary ") and f"run dir {run}" in data
    assert "2 steps" in data and "64 tokens a step" in data
    assert legend.startswith("step lines: mem = rank 0's peak memory in MB") and "floor =" in legend
    step_lines = [x for x in lines if re.match(r"step +\d+  loss ", x)]
    assert step_lines and lines.index(step_lines[0]) > 2 and " / floor " in step_lines[0]
    code, out, _ = run_cli(tiny_args(small_dataset, tmp_path / "quiet"), capsys)
    assert code == 0 and out == ""
