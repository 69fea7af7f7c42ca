"""Hugging Face side of exports: the remote-code model files and what an export writes.

``configuration_boostlr.py``, ``modeling_boostlr.py`` and ``modeling_boostlr_moe.py`` import
torch and transformers only and are copied verbatim into each low-rank or MoE export;
importing this package imports neither (transformers stays an optional dependency of boostlr).
"""

from pathlib import Path

HF_DIR = Path(__file__).parent
CONFIG_MODULE = "configuration_boostlr"
MODELING_MODULE = "modeling_boostlr"
MOE_MODULE = "modeling_boostlr_moe"  # imported by the modeling module (relative import)
REMOTE_CODE_FILES = (f"{CONFIG_MODULE}.py", f"{MODELING_MODULE}.py", f"{MOE_MODULE}.py")
