"""TOML text of a plain mapping: ``tomli_w.dumps`` when tomli-w is installed, else the same text.

boostlr writes a TOML (a run's ``config.toml``, a hardware profile) on its training path, and
a machine may have torch and boostlr's other needs but not tomli-w (the lent GPU machine's
image has no registry to install it from). The fallback writes what tomli-w 1.x writes for
what boostlr writes (tables, strings, numbers, booleans, arrays of those): byte for byte
(tests/test_toml_write.py holds them equal); anything else is left to tomli-w and refused here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

BARE_KEY = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
ESCAPES = {"\b": "\\b", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}
INDENT = "    "


def dumps(data: Mapping[str, Any]) -> str:
    """``data`` as TOML text, as ``tomli_w.dumps(data)`` writes it."""
    try:
        import tomli_w
    except ImportError:
        return "".join(_table(data, ""))
    return tomli_w.dumps(data)


def _table(table: Mapping[str, Any], name: str) -> Iterator[str]:
    literals = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    written = False
    if name and (literals or not tables):
        written = True
        yield f"[{name}]\n"
    for key, value in literals:
        written = True
        yield f"{_key(key)} = {_value(value, 0)}\n"
    for key, value in tables:
        if written:
            yield "\n"
        written = True
        yield from _table(value, f"{name}.{_key(key)}" if name else _key(key))


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"TOML keys are strings, not {type(key).__qualname__}")
    return key if key and BARE_KEY.issuperset(key) else _string(key)


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in ESCAPES:
            out.append(ESCAPES[char])
        elif (ord(char) < 32 and char != "\t") or ord(char) == 127:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _value(value: Any, level: int) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple) and not any(isinstance(v, Mapping) for v in value):
        if not value:
            return "[]"
        items = ",\n".join(INDENT * (level + 1) + _value(v, level + 1) for v in value)
        return f"[\n{items},\n{INDENT * level}]"
    raise TypeError(f"writing a {type(value).__qualname__} to TOML needs tomli-w installed")
