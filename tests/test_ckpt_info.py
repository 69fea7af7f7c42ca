"""``boostlr ckpt info``: the report of good checkpoints, and exit 2 on damaged or foreign ones.

Checkpoints come from the real trainer (one process here; TP 2 for the sharded one), and the
damaged files are chosen from ``meta.json``'s own list, so the tests hold for every
checkpoint format that keeps the ``meta.json`` contract.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train import tiny_run_config

from boostlr.cli import main
from boostlr.config import build_config
from boostlr.models.counting import count_params
from boostlr.train import run as trainer


@pytest.fixture(scope="module")
def run_dir(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run with checkpoints at steps 3 and 6."""
    run = tmp_path_factory.mktemp("ckpt_info") / "run"
    trainer.train(tiny_run_config(small_dataset), run, console=False)
    return run


def ckpt_info(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["ckpt", "info", *args])
    out, err = capsys.readouterr()
    return code, out, err


def listed_files(ckpt: Path) -> dict[str, dict]:
    return json.loads((ckpt / "meta.json").read_text())["files"]


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("boostlr: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def check_report(run: Path, step: int, capsys: pytest.CaptureFixture[str]) -> dict:
    """Text and JSON reports of ``run``'s newest checkpoint agree with the files on disk."""
    ckpt = run / "checkpoints" / f"step_{step}"
    files = listed_files(ckpt)
    code, text, err = ckpt_info([str(run)], capsys)
    assert code == 0 and err == "", err  # no progress bar when stderr is not a terminal
    assert f"step        {step}\n" in text and text.rstrip().splitlines()[-1].startswith("verified")
    assert all(f"  {name} " in text for name in files)
    code, out, _ = ckpt_info([str(ckpt), "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and info["verified"] is True
    assert info["path"] == str(ckpt) and info["step"] == step
    assert {f["name"]: f["size"] for f in info["files"]} == {
        name: (ckpt / name).stat().st_size for name in files
    }
    assert info["total_size"] == sum((ckpt / name).stat().st_size for name in files)
    assert f"{info['total_size']:,} B" in text
    cfg = build_config(run / "config.toml")
    assert info["parameters"] == count_params(cfg.model).total
    assert f"parameters  {info['parameters']:,} in {info['tensors']} tensors" in text
    assert info["model"]["dim"] == cfg.model.dim and info["model"]["arch"] == cfg.model.arch
    p = cfg.parallel
    assert {k: info["layout"][k] for k in ("pp", "dp", "tp")} == {
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
    }
    assert f"layout      pp {p.pp} x dp {p.dp} x tp {p.tp}" in text
    return info


def test_info_reports_and_verifies_a_one_process_checkpoint(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = check_report(run_dir, 6, capsys)  # a run directory: its newest checkpoint
    assert info["model"]["arch"] == "cola"
    code, out, _ = ckpt_info([str(run_dir / "checkpoints" / "step_3")], capsys)
    assert code == 0 and "step        3\n" in out


def test_info_names_the_expert_parallel_degree(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint written at ep > 1 records ``ep`` in its layout; the report names it."""
    ckpt = Path(shutil.copytree(run_dir / "checkpoints" / "step_6", tmp_path / "step_6"))
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["layout"] |= {"dp": 2, "ep": 2}
    meta_path.write_text(json.dumps(meta))
    code, text, _ = ckpt_info([str(ckpt)], capsys)
    assert code == 0 and "layout      pp 1 x dp 2 x tp 1, ep 2\n" in text, text
    code, out, _ = ckpt_info([str(ckpt), "--json"], capsys)
    assert json.loads(out)["layout"]["ep"] == 2


def test_progress_bar_on_a_terminal(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then treats stderr as a terminal
    code, out, err = ckpt_info([str(run_dir)], capsys)
    assert code == 0 and "verifying" in err and out.rstrip().splitlines()[-1].startswith("verified")


@pytest.mark.slow
def test_info_reports_and_verifies_a_sharded_checkpoint(
    sharded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = check_report(sharded_run, 3, capsys)
    assert info["sharded"] is True and info["layout"]["tp"] == 2
    assert ".metadata" in {f["name"] for f in info["files"]}


def damaged_copy(run_dir: Path, tmp_path: Path, which: str) -> tuple[Path, str]:
    """A copy of the newest checkpoint and the name of the listed file to damage."""
    ckpt = Path(shutil.copytree(run_dir / "checkpoints" / "step_6", tmp_path / "step_6"))
    files = listed_files(ckpt)
    name = max(files, key=lambda n: files[n]["size"]) if which == "largest" else which
    assert name in files
    return ckpt, name


@pytest.mark.parametrize("which", ["largest", "tokenizer.json"])
def test_a_flipped_byte_fails_the_hash(
    run_dir: Path, tmp_path: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, name = damaged_copy(run_dir, tmp_path, which)
    data = bytearray((ckpt / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
    (ckpt / name).write_bytes(bytes(data))
    code, out, err = ckpt_info([str(ckpt)], capsys)
    assert_one_line_error(code, err, name, "sha256", "corrupt")
    assert out == ""


@pytest.mark.parametrize("which", ["largest", "tokenizer.json"])
def test_a_truncated_file_is_named(
    run_dir: Path, tmp_path: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, name = damaged_copy(run_dir, tmp_path, which)
    size = (ckpt / name).stat().st_size
    with open(ckpt / name, "r+b") as fh:
        fh.truncate(size - 1)
    code, _, err = ckpt_info([str(ckpt), "--json"], capsys)
    assert_one_line_error(code, err, name, "truncated", f"{size - 1:,} bytes")


@pytest.mark.parametrize("which", ["largest", "tokenizer.json"])
def test_a_missing_file_is_named(
    run_dir: Path, tmp_path: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, name = damaged_copy(run_dir, tmp_path, which)
    (ckpt / name).unlink()
    code, _, err = ckpt_info([str(ckpt)], capsys)
    assert_one_line_error(code, err, name, "missing")


def test_a_damaged_newest_checkpoint_of_a_run_is_reported(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a run directory the newest checkpoint is checked, not silently an older one."""
    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    newest = run / "checkpoints" / "step_6"
    (newest / "tokenizer.json").write_bytes(b"{}")
    code, _, err = ckpt_info([str(run)], capsys)
    assert_one_line_error(code, err, str(newest), "tokenizer.json")


def foreign_path(kind: str, root: Path) -> Path:
    """A path of the given kind that is not a boostlr checkpoint."""
    if kind == "missing":
        return root / "nowhere"
    if kind == "run-without-checkpoints":
        (root / "checkpoints").mkdir()
        return root
    if kind == "file":
        (root / "notes.txt").write_text("hi")
        return root / "notes.txt"
    meta = {
        "bad-json": "{half",
        "no-file-list": '{"step": 1}',
        "name-outside": '{"step": 1, "files": {"../x": {"size": 1, "sha256": "0"}}}',
    }[kind]
    (root / "meta.json").write_text(meta)
    return root


@pytest.mark.parametrize(
    ("kind", "fragment"),
    [
        ("missing", "does not exist"),
        ("run-without-checkpoints", "not a checkpoint (no meta.json)"),
        ("file", "not a checkpoint (no meta.json)"),
        ("bad-json", "not a boostlr checkpoint manifest"),
        ("no-file-list", "no step or file list"),
        ("name-outside", "no step or file list"),
    ],
)
def test_foreign_paths_exit_2(
    tmp_path: Path, kind: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = ckpt_info([str(foreign_path(kind, tmp_path))], capsys)
    assert_one_line_error(code, err, fragment)
