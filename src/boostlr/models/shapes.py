"""The block's seven linears and their shapes, without torch: what planning reads.

The cost model and the parameter initialiser need the shapes but not the modules, so they
come from here rather than from :mod:`boostlr.models.llama`.
"""

from __future__ import annotations

from boostlr.config import ModelConfig

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LINEARS = ATTN_LINEARS + MLP_LINEARS


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of each of the seven block linears."""
    d, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    return {
        "q_proj": (d, d),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (d, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }
