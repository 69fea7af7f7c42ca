"""The oldest torch boostlr runs on, checked first thing in ``boostlr``.

boostlr relies on torch behaviour that older releases lack: FSDP2's ``DefaultAllGather`` /
``set_custom_all_gather`` (absent before 2.9), and pipelining that takes FSDP-wrapped stages
(2.9 and 2.10 fail the pp x dp tests, benchmarks/RESULTS.md "torch range"). The floor is the
oldest release whose parallel core CI runs (``.ci/run``, ``tests/parallel_core.txt``): GPU
images and clusters pin older torch than the newest, so the floor is as low as the tests
allow. Without this check an old torch dies with a traceback inside each rank, or worse, in a
collective; with it, one line names the installed and the needed version before anything
starts. The private torch symbols that differ between releases live in
:mod:`boostlr._torch_internals`.
"""

from __future__ import annotations

import re
import sys

from boostlr.errors import EXIT_BAD_INPUT, BoostlrError

# pyproject.toml's ``torch>=`` bound; tests/test_torch_floor.py keeps the two equal. It is the
# oldest release the parallel core passes on (benchmarks/RESULTS.md, "torch range").
TORCH_FLOOR = "2.11"


class TorchTooOld(BoostlrError):
    """The installed torch predates :data:`TORCH_FLOOR`."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a torch version string: ``(2, 9, 1)`` for ``2.9.1+cu128``.

    Local tags (``+cpu``) and pre-release suffixes (``a0+git...``, ``.dev2025...``) are
    dropped, so a vendor build of an upcoming release (NGC's ``2.9.0a0+...``) counts as
    that release.
    """
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(piece):  # "0a0", "0rc1": the release number ends here
            break
    if not parts:
        raise ValueError(f"not a torch version: {version!r}")
    return tuple(parts)


def check_torch_version(installed: str, floor: str = TORCH_FLOOR) -> None:
    """Raise :class:`TorchTooOld` (one line, with the fix) when ``installed`` < ``floor``."""
    if release(installed) < release(floor):
        raise TorchTooOld(
            f"torch {installed} is installed but boostlr needs torch>={floor}: "
            f"upgrade it (pip install 'torch>={floor}') or use an image that has it"
        )


def require_torch() -> int | None:
    """The CLI's first call: on a too-old torch, print one line and return exit code 2."""
    import torch

    try:
        check_torch_version(torch.__version__)
    except TorchTooOld as exc:
        print(f"boostlr: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return None
