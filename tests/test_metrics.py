"""``metrics.jsonl`` truncation on resume, including a last row cut off by a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boostlr.errors import BoostlrError
from boostlr.train.metrics import MetricsLog, truncate_after


def write_log(path: Path, steps: range, tail: str = "") -> list[str]:
    """Rows through the real writer, then ``tail`` appended raw (a crash mid-write)."""
    log = MetricsLog(path)
    for step in steps:
        log.write({"step": step, "loss": 1.0 / step})
    log.write({"event": "restart", "step": 2})
    log.close()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(tail)
    return path.read_text(encoding="utf-8").splitlines()


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("tail", ['{"step": 6, "lo', "{", '{"step": 6, "loss": 0.1', "\n\n"])
def test_half_written_last_line_is_dropped(tmp_path: Path, tail: str) -> None:
    path = tmp_path / "metrics.jsonl"
    write_log(path, range(1, 6), tail)
    truncate_after(path, 3)
    assert steps_of(path) == [1, 2, 3, 2]
    truncate_after(path, 3)  # idempotent, and the result parses line by line
    assert steps_of(path) == [1, 2, 3, 2]


def test_half_written_line_is_dropped_even_when_resuming_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_log(path, range(1, 6), '{"step": 6, "loss": 0.')
    truncate_after(path, 100)
    assert steps_of(path) == [1, 2, 3, 4, 5, 2]
    assert path.read_text().endswith("\n")  # the next row starts on a line of its own


def test_complete_last_row_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_log(path, range(1, 3), '{"step": 3, "loss": 0.25}')
    truncate_after(path, 3)
    assert steps_of(path) == [1, 2, 2, 3]


def test_damage_before_the_last_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = write_log(path, range(1, 4))
    lines.insert(1, "garbage")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BoostlrError, match=r"metrics\.jsonl:2 is not a JSON object"):
        truncate_after(path, 3)
    assert path.read_text().splitlines() == lines  # left as it was


def test_missing_log_is_fine(tmp_path: Path) -> None:
    truncate_after(tmp_path / "metrics.jsonl", 3)
    assert not (tmp_path / "metrics.jsonl").exists()
