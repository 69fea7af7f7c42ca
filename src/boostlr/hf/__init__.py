"""Hugging Face side of exports: the remote-code model files and what an export writes.

``configuration_boostlr.py`` and ``modeling_boostlr.py`` import torch and transformers only
and are copied verbatim into each low-rank or MoE export, an MoE export also getting
``moe_grouped.py`` (the experts' dispatch math, torch only: boostlr's MoE layer imports the
same file) and ``modeling_boostlr_moe.py``; importing this package imports neither
(transformers stays an optional dependency of boostlr).
"""

from pathlib import Path

HF_DIR = Path(__file__).parent
CONFIG_MODULE = "configuration_boostlr"
MODELING_MODULE = "modeling_boostlr"
MOE_MODULE = "modeling_boostlr_moe"
#: The dispatch math boostlr's MoE layer and the MoE remote code share (torch only).
MOE_MATH_MODULE = "moe_grouped"
REMOTE_CODE_FILES = (f"{CONFIG_MODULE}.py", f"{MODELING_MODULE}.py")
#: What an MoE export carries: the files above, the dispatch math and the MoE model, which
#: imports them (the model last).
MOE_REMOTE_CODE_FILES = (*REMOTE_CODE_FILES, f"{MOE_MATH_MODULE}.py", f"{MOE_MODULE}.py")
