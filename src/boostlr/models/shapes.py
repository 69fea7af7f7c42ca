"""The block's seven linears and their shapes, without torch: what planning reads.

The cost model and the parameter initialiser need the shapes but not the modules, so they
come from here rather than from :mod:`boostlr.models.llama`. The MLP's linears are also named
by role (:class:`MlpLinears`): the tensor-parallel strategies act on an MLP through its
roles (:mod:`boostlr.models.mlp`), never through these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.config import ModelConfig
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe_layer


@dataclass(frozen=True)
class MlpLinears:
    """An MLP's linears by what they do to the residual stream.

    ``reads``: the linears that read the normed residual (column-parallel under Megatron,
    folded into the norm's grouped down-projection under BTP), in order; ``writes``: the one
    that writes the residual back (row-parallel: the block's all-reduce follows it).
    """

    reads: tuple[str, ...]
    writes: str

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.reads, self.writes)


#: LLaMA's gated MLP: ``down(gate(x) ⊙ up(x))`` (with or without SiLU on ``gate``).
GATED_MLP = MlpLinears(reads=("gate_proj", "up_proj"), writes="down_proj")

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = GATED_MLP.names
LINEARS = ATTN_LINEARS + MLP_LINEARS
#: The module of the block that holds each linear (``layers.{i}.{holder}.{linear}``).
HOLDER = {**dict.fromkeys(ATTN_LINEARS, "self_attn"), **dict.fromkeys(MLP_LINEARS, "mlp")}
#: The linears that write the residual stream (the others read the normed residual, or
#: attention's output).
WRITES_RESIDUAL = ("o_proj", GATED_MLP.writes)


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


def crossing_latents(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The previous block's latents that block ``layer`` reads, in :data:`LINEARS` order:
    LaX's seven, none for an arch without a crossing.

    An MoE block (from ``moe_dense_layers`` on) reads all but ``down_proj``'s: its shared
    ``B_d`` has no in-factor, and the experts' ``A_d^e`` take no crossing (docs/moe.md). A
    pipeline stage boundary carries exactly these (:mod:`boostlr.parallel.pipeline`).
    """
    if not arch_spec(cfg.arch).crossing:
        return ()
    moe = is_moe_layer(cfg, layer)
    return tuple(n for n in LINEARS if not (moe and n == GATED_MLP.writes))


def block_linear(name: str) -> str | None:
    """The block linear parameter ``name`` belongs to (``layers.3.mlp.up_proj.down.weight``
    -> ``up_proj``), ``None`` for any other parameter: a new module's parameters (an MLP
    kind's router, say) must get rules of their own, not fall into a linear's."""
    parts = name.split(".")
    if len(parts) < 5 or parts[0] != "layers" or parts[3] not in HOLDER:
        return None
    return parts[3]
