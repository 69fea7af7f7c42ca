"""The documentation stays true to the tree: the generated config reference matches the
schema, every relative link in README.md and docs/ reaches a file (and a heading, where it
names one), and the README stays a front page that opens with the commands it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            kept.append(line)
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    body = re.sub(r"`[^`\n]*`", "", prose(page.read_text(encoding="utf-8")))
    return LINK.findall(body)


def test_slug_follows_github() -> None:
    assert slug("3D parallelism") == "3d-parallelism"
    assert slug("`model.n_kv_heads`") == "modeln_kv_heads"
    assert slug("2.3 Bottleneck-aware TP (BTP) — `parallel/btp.py`") == (
        "23-bottleneck-aware-tp-btp--parallelbtppy"
    )
    assert slug("Planning a run: `boostlr plan` and `boostlr calibrate`") == (
        "planning-a-run-boostlr-plan-and-boostlr-calibrate"
    )


def test_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Real heading\n")
    page.write_text(
        "[ok](b.md#real-heading) [gone](c.md) [code `x`](b.md#nope)\n"
        "```\n[not a link](missing.md)\n```\n`[also not](missing.md)`\n"
    )
    assert broken(page) == ["c.md: no such file", "b.md#nope: no heading 'nope' in b.md"]


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading '{anchor}' in {dest.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == [], f"{page.relative_to(ROOT)} has broken links"


def test_links_stay_inside_the_repository() -> None:
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            dest = (page.parent / target.partition("#")[0]).resolve()
            assert dest.is_relative_to(ROOT), f"{page.name} links outside the repo: {target}"


def test_config_reference_is_current() -> None:
    from boostlr.config.reference import REGENERATE, reference_markdown

    current = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert current == reference_markdown(), (
        f"docs/config.md is out of date with src/boostlr/config/schema.py: run `{REGENERATE}`"
    )


def test_regenerate_command_prints_the_reference() -> None:
    """``python -m boostlr.config.reference`` (what the stale-page message says to run)."""
    import os
    import subprocess
    import sys

    from boostlr.config.reference import reference_markdown

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "boostlr.config.reference"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout == reference_markdown()


def test_config_reference_covers_every_key() -> None:
    import dataclasses

    from boostlr.config import RunConfig
    from boostlr.config.reference import reference_markdown

    text = reference_markdown()
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f"### `{section.name}.{f.name}`" in text
    assert '- default: `"float32"`' in text.split("### `train.dtype`")[1].split("###")[0]
    assert "- allowed: `float32`, `bfloat16`" in text


def test_readme_is_a_front_page() -> None:
    """It opens with the set-up, the main job and the test command, and stays short."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 260
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ['pip install -e ".[dev]"', "boostlr train", "python -m pytest -q"]
    # CI runs the README's test command; keep the two in step.
    assert "python3 -m pytest -q" in (ROOT / ".ci" / "run").read_text()
