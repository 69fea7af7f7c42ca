"""Figures: training curves of runs (:mod:`.runs`, ``boostlr plot``) and the cost model's
views of a config (:mod:`.plan`, ``boostlr plan --plot``). Both need matplotlib, the
``plot`` extra, and fail with one line before any work when it is missing."""

from __future__ import annotations

from boostlr.errors import BoostlrError


def require_matplotlib(command: str) -> None:
    """Fail before any work when the ``plot`` extra is missing (exit code 2)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BoostlrError(
            f"{command} needs matplotlib: pip install 'boostlr[plot]' (or pip install matplotlib)"
        ) from None
