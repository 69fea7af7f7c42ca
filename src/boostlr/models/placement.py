"""Where each parameter and each block lives across ranks: the one table of sharding rules.

The tensor-parallel strategies (:mod:`boostlr.parallel`) shard by it and the planner
(:mod:`boostlr.analysis.memory`) counts by it, so what a rank holds and what the plan says
it holds cannot drift apart. A parameter name is parsed whole (the names of
:mod:`boostlr.models.llama`, HF LLaMA's) into its kind; a name that is no kind, or a kind a
strategy has no rule for, is an error: renaming a module must fail here, not quietly
replicate a parameter. Torch-free, so planning a 40B model imports no torch.
"""

from __future__ import annotations

from boostlr.config import ParallelConfig
from boostlr.models.shapes import ATTN_LINEARS, MLP_LINEARS
from boostlr.specs.moe import MOE_PARTS
from boostlr.specs.strategy import BTP, MEGATRON, VANILLA

# Parameter kinds.
EMBEDDING = "embedding"  # embed_tokens.weight [V, d]
HEAD = "head"  # lm_head.weight [V, d]
FINAL_NORM = "final norm"  # norm.weight [d]
BLOCK_NORM = "block norm"  # layers.{i}.{input,post_attention}_layernorm.weight [d]
DENSE_FROM_NORM = "dense linear reading the normed residual"  # q/k/v/gate/up (full) [out, d]
DENSE_TO_RESIDUAL = "dense linear writing the residual"  # o/down (full) [d, in]
DOWN = "low-rank A"  # {linear}.down.weight [r, d_in]
UP = "low-rank B"  # {linear}.up.weight [d_out, r]
CROSS_NORM = "LaX latent norm"  # {linear}.cross.norm.weight [r]
CROSS_GATE = "LaX crossing gate"  # {linear}.cross.gate{,_down,_up}.weight (r -> r)
#: mlp.{router,experts,shared}.*: an MoE MLP's own parameters (its shared outer factors are
#: DOWN/UP of gate/up/down_proj). The single-device model and BTP have a rule.
MOE = "MoE router or expert"
KINDS = (
    EMBEDDING,
    HEAD,
    FINAL_NORM,
    BLOCK_NORM,
    DENSE_FROM_NORM,
    DENSE_TO_RESIDUAL,
    DOWN,
    UP,
    CROSS_NORM,
    CROSS_GATE,
    MOE,
)

#: The shard dim of each parameter kind per strategy (``None``: replicated). ``None`` as the
#: strategy is the single-device model. A strategy lists only the kinds it can run: the
#: config refuses megatron for low-rank archs and btp/vanilla for ``full``.
RULES: dict[str | None, dict[str, int | None]] = {
    None: dict.fromkeys(KINDS),
    MEGATRON.name: {
        EMBEDDING: 0,  # vocab-parallel rows
        HEAD: 0,
        FINAL_NORM: None,  # norms run on the replicated residual
        BLOCK_NORM: None,
        DENSE_FROM_NORM: 0,  # column-parallel: heads / MLP width split
        DENSE_TO_RESIDUAL: 1,  # row-parallel: its input split, all-reduced after
    },
    VANILLA.name: {
        EMBEDDING: 0,  # vocab-parallel, as Megatron's
        HEAD: 0,
        FINAL_NORM: None,  # norms run on the replicated residual
        BLOCK_NORM: None,
        DOWN: 0,  # A column-parallel: its rank rows split
        UP: 1,  # B row-parallel: its rank columns split, all-reduced after
        CROSS_NORM: None,  # LaX crosses the all-gathered latent
        CROSS_GATE: None,
    },
    BTP.name: {
        EMBEDDING: 1,  # split along d: the lookup yields this rank's residual slice
        HEAD: 0,  # vocab-parallel after one all-gather of the last hidden state
        FINAL_NORM: 0,  # gains follow the d-sharded residual
        BLOCK_NORM: 0,
        DOWN: 1,  # A row-parallel: its input split
        UP: 0,  # B column-parallel: its output split
        CROSS_NORM: None,  # LaX acts on the replicated latents
        CROSS_GATE: None,
        # Whole: the experts act on the replicated latents; the router (E x d, small) is
        # used row-parallel by its d-slice, its gradient summed over tp (parallel/btp_moe).
        MOE: None,
    },
}

_TOP = {"embed_tokens.weight": EMBEDDING, "lm_head.weight": HEAD, "norm.weight": FINAL_NORM}
#: The vocabulary's parameters: their rows may also split over dp (``parallel.vocab_dp``).
VOCAB_PARAMS = tuple(name for name, kind in _TOP.items() if kind in (EMBEDDING, HEAD))
_BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")
_HOLDER = {**dict.fromkeys(ATTN_LINEARS, "self_attn"), **dict.fromkeys(MLP_LINEARS, "mlp")}
_WRITES_RESIDUAL = ("o_proj", "down_proj")
_LINEAR_PARTS = {
    "down.weight": DOWN,
    "up.weight": UP,
    "cross.norm.weight": CROSS_NORM,
    "cross.gate.weight": CROSS_GATE,
    "cross.gate_down.weight": CROSS_GATE,
    "cross.gate_up.weight": CROSS_GATE,
}


def param_kind(name: str) -> str | None:
    """The kind of parameter ``name`` (a single-device name), ``None`` if it is no known one."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    holder, linear, *tail = parts[2:]
    if holder in _BLOCK_NORMS:
        return BLOCK_NORM if (linear, *tail) == ("weight",) else None
    if holder == "mlp" and linear in MOE_PARTS and tail:
        return MOE
    if _HOLDER.get(linear) != holder or not tail:
        return None
    part = ".".join(tail)
    if part == "weight":
        return DENSE_TO_RESIDUAL if linear in _WRITES_RESIDUAL else DENSE_FROM_NORM
    return _LINEAR_PARTS.get(part)


def shard_dim(name: str, strategy: str | None, tied: bool = False) -> int | None:
    """The dim ``strategy`` splits parameter ``name`` along over tp (``None``: replicated).

    ``tied``: the embedding is the LM head's table (``model.tie_embeddings``) and follows the
    head's rule, the one parameter split one way (under BTP its rows over the vocabulary:
    the lookup is then vocabulary-parallel, reduce-scattered to the rank's d-slice).
    Raises ``ValueError`` naming both for a name that is no known parameter, or one the
    strategy has no rule for.
    """
    label = strategy or "single-device"
    if strategy not in RULES:
        raise ValueError(f"no sharding rules for tp strategy {label!r} (parameter {name!r})")
    kind = param_kind(name)
    if kind is None:
        raise ValueError(
            f"no sharding rule for parameter {name!r} under tp strategy {label!r}: it is no "
            "parameter boostlr.models.placement knows (a renamed module?)"
        )
    rules = RULES[strategy]
    if tied and kind == EMBEDDING:
        kind = HEAD
    if kind not in rules:
        raise ValueError(
            f"no sharding rule for parameter {name!r} ({kind}) under tp strategy {label!r}"
        )
    return rules[kind]


def chunk_range(size: int, rank: int, tp: int) -> tuple[int, int]:
    """``[start, end)`` of rank's chunk of a dim of ``size`` split ``torch.chunk``-style.

    Chunks are ``ceil(size / tp)`` long (the last ones shorter, possibly empty), as DTensor's
    ``Shard`` splits: a vocabulary that ``tp`` does not divide keeps its global shape.
    """
    step = -(-size // tp)
    start = min(rank * step, size)
    return start, min(start + step, size)


def stage_ids(p: ParallelConfig, pp_rank: int) -> list[int]:
    """Global stage indices held by ``pp_rank`` (interleaved: loop order, rank + k*pp)."""
    return [pp_rank + k * p.pp for k in range(p.virtual_stages)]


def stage_layers(n_layers: int, num_stages: int, stage: int) -> range:
    """The blocks of pipeline stage ``stage``: an equal split (the config checks it divides)."""
    per = n_layers // num_stages
    return range(stage * per, (stage + 1) * per)
