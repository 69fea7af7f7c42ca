"""Looking a spec up by its name, the same way for every kind of spec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

Spec = TypeVar("Spec")


def lookup(table: Mapping[str, Spec], name: str, what: str) -> Spec:
    """``table[name]``, or a ``ValueError`` naming ``what`` and every known name: the config
    reaches specs by user-given names, so the error must say what would have worked."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}: one of {', '.join(table)}") from None
