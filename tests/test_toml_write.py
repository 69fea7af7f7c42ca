"""boostlr writes TOML without tomli-w (the lent GPU machine lacks it) exactly as tomli-w does."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from boostlr._toml_write import dumps
from boostlr.analysis.hardware import available, load_profile
from boostlr.config import build_config, dump_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))


@pytest.fixture
def no_tomli_w(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tomli_w", None)  # `import tomli_w` raises ImportError


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_run_config_is_written_byte_for_byte_as_tomli_w_writes_it(path, no_tomli_w) -> None:
    cfg = build_config(path, overrides=[("parallel.dp", "-1"), ("parallel.nproc", "64")])
    text = dump_toml(cfg)  # by the fallback: tomli-w cannot be imported
    assert text == tomli_w.dumps(tomllib.loads(text))


@pytest.mark.parametrize("name", available())
def test_a_hardware_profile_is_written_as_tomli_w_writes_it(name: str, monkeypatch) -> None:
    profile = load_profile(name)
    with_library = profile.to_toml()
    monkeypatch.setitem(sys.modules, "tomli_w", None)
    assert profile.to_toml() == with_library


scalars = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
keys = st.text(min_size=0, max_size=8)
tables = st.recursive(
    st.dictionaries(keys, values, max_size=4),
    lambda inner: st.dictionaries(keys, inner | values, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(tables)
def test_the_fallback_writes_what_tomli_w_writes(data: dict) -> None:
    expected = tomli_w.dumps(data)
    saved = sys.modules.get("tomli_w")
    sys.modules["tomli_w"] = None  # type: ignore[assignment]
    try:
        text = dumps(data)
    finally:
        sys.modules["tomli_w"] = saved  # type: ignore[assignment]
    assert text == expected
    assert tomllib.loads(text) == data


def test_infinities_and_what_the_fallback_refuses(no_tomli_w) -> None:
    data = {"a": math.inf, "b": -math.inf, "t": {"x": [1, [2.5, "q"]]}}
    assert dumps(data) == tomli_w.dumps(data)
    with pytest.raises(TypeError, match="needs tomli-w"):
        dumps({"when": object()})
