"""``boostlr plot``: PNGs of one and several runs, axes from the config, errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import tiny_run_config

from boostlr.cli import main
from boostlr.config import build_config, dump_toml
from boostlr.models.counting import flops_per_token
from boostlr.plots.runs import ema, label, load_run
from boostlr.train import run as trainer

image = pytest.importorskip("matplotlib.image")


def _fake_run(root: Path, arch: str, tp: int, scale: float) -> Path:
    """A run directory as the trainer leaves it: resolved config.toml and metrics rows."""
    overrides = [("model.preset", "tiny"), ("model.arch", arch), ("parallel.tp", str(tp))]
    cfg = build_config(overrides=[*overrides, ("train.batch_size", "4"), ("data.seq_len", "32")])
    cfg.model.vocab_size = 512
    run = root / f"{arch}-tp{tp}"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(cfg))
    rows = []
    for step in range(1, 41):
        rows.append({"step": step, "loss": scale * (6 - step / 10), "tokens_per_s": 1000.0 + step})
        if step % 10 == 0:
            rows.append({"step": step, "val_loss": scale * (6.2 - step / 10)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    pixels = image.imread(path)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 5  # not blank


def test_plot_one_real_run(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(
        small_dataset,
        **{
            "data.val_batches": 1,
            "train.batch_size": 2,
            "train.steps": 4,
            "train.warmup": 30,
            "train.eval_every": 2,
            "train.ckpt_every": 100,
        },
    )
    trainer.train(cfg, run, console=False)
    out = tmp_path / "one.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    _assert_png(out)


def test_plot_three_runs_on_tokens_and_flops(tmp_path: Path) -> None:
    runs = [
        _fake_run(tmp_path, "full", 1, 1.0),
        _fake_run(tmp_path, "cola", 2, 0.9),
        _fake_run(tmp_path, "svd", 1, 0.95),
    ]
    for x, y in [("tokens", "loss"), ("flops", "val_loss"), ("step", "tokens_per_s")]:
        out = tmp_path / f"three-{x}-{y}.png"
        assert main(["plot", *map(str, runs), "--out", str(out), "--x", x, "--y", y]) == 0
        _assert_png(out)
    cola = load_run(runs[1])
    assert label(cola.cfg) == "cola r=16, btp, pp1×dp1×tp2"
    assert label(load_run(runs[0]).cfg) == "full"
    per_token = flops_per_token(cola.cfg.model, 32)
    xs, ys = cola.series("val_loss", "flops")
    assert xs == [step * 4 * 32 * per_token for step in (10, 20, 30, 40)]
    assert ys == pytest.approx([0.9 * (6.2 - s / 10) for s in (10, 20, 30, 40)])
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased
    assert ema([4.0, 2.0], 0.0) == [4.0, 2.0]


def test_plot_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _fake_run(tmp_path, "full", 1, 1.0)
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    out = str(tmp_path / "x.png")
    for args, message in [
        (["plot", str(not_a_run), "--out", out], "is not a run directory"),
        (["plot", str(run), str(not_a_run), "--out", out], "is not a run directory"),
        (["plot", str(run), "--out", out, "--y", "nope"], "--y 'nope' is in no run's"),
        (["plot", str(run), "--out", str(tmp_path / "x.nope")], "--out"),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.png").exists()


def _pixels_near(pixels, rgb: tuple[float, float, float]) -> int:
    """Pixels of the image within a small distance of colour ``rgb`` (0..1)."""
    import numpy as np

    diff = np.abs(pixels[..., :3] - np.array(rgb)).max(axis=-1)
    return int((diff < 0.12).sum())


def _same_twice(tmp_path: Path) -> list[Path]:
    import shutil

    first = _fake_run(tmp_path, "cola", 2, 1.0)
    return [first, shutil.copytree(first, tmp_path / "again")]


@pytest.mark.parametrize("y", ["loss", "tokens_per_s"])
def test_identical_runs_stay_visible_in_the_image(tmp_path: Path, y: str) -> None:
    """A rerun logs the same numbers: its curve must not hide the first one's. In the PNG,
    the first run's colour (C0) covers a good part of what the second one's (C1) does, not
    just its legend line (drawn over, it covers under a tenth)."""
    out = tmp_path / f"same-{y}.png"
    assert main(["plot", *map(str, _same_twice(tmp_path)), "--out", str(out), "--y", y]) == 0
    pixels = image.imread(out)
    blue, orange = (0.122, 0.467, 0.706), (1.0, 0.498, 0.055)  # matplotlib's C0 and C1
    shown, top = _pixels_near(pixels, blue), _pixels_near(pixels, orange)
    assert top > 0 and shown > 0.2 * top, (shown, top)


def test_identical_runs_differ_in_dash_marker_and_marker_places(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from boostlr.plots.runs import draw

    fig = draw([load_run(r) for r in _same_twice(tmp_path)], "step", "loss", 0.6, None)
    curves = [line for line in fig.axes[0].lines if not line.get_label().startswith("_")]
    curves = [line for line in curves if line.get_label() != "validation loss"]
    plt.close(fig)
    assert len(curves) == 2
    a, b = ((c.get_linestyle(), c.get_marker(), c.get_markevery()) for c in curves)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2], (a, b)
