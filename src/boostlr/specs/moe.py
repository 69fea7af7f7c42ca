"""What a mixture-of-experts model is: its blocks, dispatch forms, balance and parameter names.

The runtime (``models/moe*.py``, ``parallel/expert_parallel.py``, ``parallel/build.py``,
``parallel/moe_steps.py``), validation (``config/validate_moe.py``), the counts and the cost
model (``models/counting.py``, ``analysis/moe.py``, ``analysis/memory.py``), the trace
(``trace/moe_routing.py``) and the export (``hf/files.py``) read these facts instead of
comparing the config's MoE names or restating which blocks and parameters are the experts'.
A new dispatch form or balance is one entry here plus its runtime (docs/extending.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from boostlr.specs.arch import ArchSpec
from boostlr.specs.table import lookup

FP32 = 4
#: Bytes of one expert count: the router's load and the ep count exchange are int64.
COUNT_BYTES = 8
#: ``model.moe_dispatch``'s value that lets the arch decide (:func:`resolve_dispatch`).
AUTO = "auto"


class MoeModel(Protocol):
    """The model config's keys these facts read (``boostlr.config.ModelConfig`` has them; the
    specs import no config, which imports the specs)."""

    @property
    def arch(self) -> str: ...
    @property
    def moe_experts(self) -> int: ...
    @property
    def moe_dense_layers(self) -> int: ...
    @property
    def moe_dispatch(self) -> str: ...
    @property
    def moe_balance(self) -> str: ...


# ----------------------------------------------------------------------------- which blocks


def is_moe(m: MoeModel) -> bool:
    """Whether the model has routed experts at all."""
    return m.moe_experts > 0


def is_moe_layer(m: MoeModel, layer: int) -> bool:
    """Whether block ``layer`` has the MoE MLP (the first ``moe_dense_layers`` stay dense)."""
    return m.moe_experts > 0 and layer >= m.moe_dense_layers


def moe_layer_count(m: MoeModel, layers: range) -> int:
    """How many of ``layers`` are MoE blocks."""
    return sum(1 for i in layers if is_moe_layer(m, i))


# ----------------------------------------------------------------------------- dispatch forms


@dataclass(frozen=True)
class DispatchSpec:
    """What a routed copy carries to its expert and back.

    ``shared_outer``: the experts share the MLP's outer factors ``A_g, A_u`` (d -> r) and
    ``B_d`` (r -> d), so a copy travels as the latent ``[σ(A_g x) | σ(A_u x)]`` (2r) and
    returns r wide, one ``B_d`` mapping the weighted sum; it needs a low-rank arch, and it is
    the form BTP runs (every TP rank holds the replicated latents it routes). Otherwise each
    expert is a whole MLP of the arch and the normed d-wide token travels (in fp32: the
    residual's norm, cast only at the experts' GEMMs), its d-wide result back; a crossing
    arch cannot take it (each whole expert would need its own crossing latents per token).
    """

    name: str
    shared_outer: bool

    def takes(self, arch: ArchSpec) -> bool:
        return arch.lowrank if self.shared_outer else not arch.crossing

    def copy_widths(self, dim: int, rank: int | None) -> tuple[int, int]:
        """Elements one routed copy carries (out to its expert, back): 2r and r, or d and d."""
        if self.shared_outer:
            return 2 * (rank or 0), rank or 0
        return dim, dim

    def copy_bytes(self, act: int) -> tuple[int, int]:
        """Bytes per element (out, back), ``act`` the compute dtype's: the latent, the hidden
        token (cast to the compute dtype before it leaves: the experts' GEMMs would cast it
        there anyway) and every expert output are in it."""
        return act, act


LATENT = DispatchSpec("latent", shared_outer=True)
HIDDEN = DispatchSpec("hidden", shared_outer=False)
#: The schema's ``MoeDispatch`` values besides ``auto``, in its order.
DISPATCHES: dict[str, DispatchSpec] = {s.name: s for s in (LATENT, HIDDEN)}


def dispatch_spec(name: str) -> DispatchSpec:
    """The spec of dispatch form ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(DISPATCHES, name, "MoE dispatch")


def default_dispatch(arch: ArchSpec) -> DispatchSpec:
    """What ``auto`` picks: the latent form where the arch has a latent, else hidden."""
    return LATENT if arch.lowrank else HIDDEN


def resolve_dispatch(configured: str, arch: ArchSpec) -> DispatchSpec:
    """``model.moe_dispatch`` with ``auto`` decided for ``arch``."""
    return default_dispatch(arch) if configured == AUTO else dispatch_spec(configured)


# ----------------------------------------------------------------------------- balance


@dataclass(frozen=True)
class BalanceSpec:
    """How a router keeps the experts evenly loaded.

    ``sigmoid_scores``: the router's scores are sigmoids of its logits, normalised over the
    experts (else a softmax). ``selection_bias``: a per-expert bias, a saved buffer
    (:data:`BALANCE_BIAS`), is added to the scores for the selection only and moved after
    each optimizer step against the step's load (DeepSeek-V3's auxiliary-loss-free balance).
    ``balance_loss``: a sequence-level balance loss weighted by ``model.moe_aux_coef``
    trains the router.
    """

    name: str
    sigmoid_scores: bool
    selection_bias: bool = False
    balance_loss: bool = False


BIAS = BalanceSpec("bias", sigmoid_scores=True, selection_bias=True)
AUX = BalanceSpec("aux", sigmoid_scores=False, balance_loss=True)
#: The schema's ``MoeBalance`` values, in its order.
BALANCES: dict[str, BalanceSpec] = {s.name: s for s in (BIAS, AUX)}


def balance_spec(name: str) -> BalanceSpec:
    """The spec of balance ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(BALANCES, name, "MoE balance")


# ----------------------------------------------------------------------------- capacity


def capacity_of(tokens: int, k: int, experts: int, factor: float) -> int:
    """Rows per expert at capacity factor ``factor``: ``ceil(factor · tokens · k / E)``."""
    return max(1, math.ceil(factor * tokens * k / experts))


# ----------------------------------------------------------------------------- parameter names

#: The MoE MLP's own modules (``layers.{i}.mlp.<part>``), beside the shared outer factors
#: that keep the dense MLP's names (``gate_proj``, ``up_proj``, ``down_proj``).
ROUTER = "router"
EXPERTS = "experts"  # the routed experts' stacked ``[E, ...]`` weights
SHARED = "shared"  # the shared experts', ``[S, ...]``
MOE_PARTS = (ROUTER, EXPERTS, SHARED)
#: The router's buffers: the balance bias (saved; ``selection_bias`` balances only) and the
#: load counted since the last bias update (not saved).
BIAS_BUFFER = "expert_bias"
LOAD_BUFFER = "load"
#: The one buffer a checkpoint holds beside the parameters, whole and equal on every rank.
BALANCE_BIAS = f"{ROUTER}.{BIAS_BUFFER}"


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` (a global name) is a routed expert's stacked weight: the
    tensors expert parallelism shards (the shared experts' are not)."""
    return f".mlp.{EXPERTS}." in name


def is_saved_buffer(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a saved buffer (the balance bias), not a
    parameter."""
    return name.endswith(BALANCE_BIAS)
