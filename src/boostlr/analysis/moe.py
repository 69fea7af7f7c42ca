"""The mixture-of-experts terms of the cost model (docs/moe.md, "Planning"; design notes §9).

An MoE block runs only on the single-device block (``tp = pp = 1``), under data parallelism
and expert parallelism (``parallel.ep`` ranks carved out of dp). What differs from a dense
block, and is counted here:

* **Traffic over ep.** Per MoE layer and micro-batch, ``dropless_ep`` exchanges the
  ``[ep, E/ep]`` int64 counts (one all-to-all, forward only), sends each routed copy out
  (``dispatch``: ``2r`` wide under ``latent``, the d-wide token under ``hidden``) and its
  result back (``combine``: ``r`` or ``d`` wide); the backward runs both in reverse, and a
  checkpointed block's re-forward repeats the forward. The ledger counts each all-to-all's
  whole input, the rank's own chunk included: the dispatch input is the rank's ``T·k``
  copies, the combine input the copies it received. Over an ep group the copies received
  equal the copies sent, so the figures here (``T·k`` received on every rank) are exact for
  the group's mean whatever the routing, and for each rank under balanced routing.
* **Expert gradients over dp_rep.** At ``ep > 1`` FSDP leaves the routed experts alone:
  each rank keeps its ``E/ep`` experts whole, replicated over the ``dp / ep`` ranks of its
  ``dp_rep`` group, and ``reduce_expert_grads`` all-reduces their fp32 gradients over it
  once per step.
* **Compute.** Per token the router (``d → E``), ``top_k`` routed and ``moe_shared``
  shared experts, and under ``latent`` the shared outer factors.
"""

from __future__ import annotations

from boostlr.config import ModelConfig, ParallelConfig
from boostlr.config.validate_moe import moe_dispatch_of
from boostlr.specs.arch import arch_spec

FP32 = 4
COUNT_BYTES = 8  # the count exchange's int64


def is_moe(m: ModelConfig) -> bool:
    return m.moe_experts > 0


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    """As :func:`boostlr.models.moe_experts.is_moe_layer`, without importing torch."""
    return m.moe_experts > 0 and layer >= m.moe_dense_layers


def is_routed_expert_name(name: str) -> bool:
    """As :func:`boostlr.parallel.expert_parallel.is_routed_expert` (a global parameter
    name), without importing the engine: the weights expert parallelism shards."""
    return ".mlp.experts." in name


def moe_layer_count(m: ModelConfig, layers: range) -> int:
    """How many of ``layers`` are MoE blocks."""
    return sum(1 for i in layers if is_moe_layer(m, i))


def latent_dispatch(m: ModelConfig) -> bool:
    return moe_dispatch_of(m) == "latent"


def routed_widths(m: ModelConfig, act: int) -> tuple[int, int, int, int]:
    """(dispatch elements, their bytes, combine elements, their bytes) per routed copy.

    ``latent``: ``z = [σ(A_g x) | σ(A_u x)]`` out and ``σ(A_d^e h)`` back, both in the compute
    dtype (``act``): 3r elements. ``hidden``: the normed token, cast to the compute dtype
    before it leaves (the experts' GEMMs would cast it there anyway), out, the expert's
    output (a GEMM's, in the compute dtype) back: 2d elements."""
    if latent_dispatch(m):
        r = m.rank or 0
        return 2 * r, act, r, act
    return m.dim, act, m.dim, act


def elements_per_copy(m: ModelConfig) -> int:
    """Elements one routed copy moves over ep, out and back: 3r (latent) or 2d (hidden)."""
    w_d, _, w_c, _ = routed_widths(m, FP32)
    return w_d + w_c


def ep_layer_bytes(m: ModelConfig, tokens: int, act: int) -> tuple[int, int]:
    """(forward, backward) ep bytes of one MoE layer for a micro-batch of ``tokens`` tokens
    on one rank: the count exchange, then the dispatch and combine all-to-alls (whole inputs;
    the combine's and the backward dispatch's are the copies received: ``T·k`` on the
    group's mean)."""
    copies = tokens * m.moe_top_k
    w_d, e_d, w_c, e_c = routed_widths(m, act)
    payload = copies * (w_d * e_d + w_c * e_c)
    return payload + m.moe_experts * COUNT_BYTES, payload


def ep_layer_calls() -> tuple[int, int]:
    """(forward, backward) all-to-alls of one MoE layer and micro-batch: counts, dispatch and
    combine; their two reverses."""
    return 3, 2


def ep_micro_bytes(m: ModelConfig, p: ParallelConfig, tokens: int, act: int) -> int:
    """One rank's ep bytes for one micro-batch (forward, backward, re-forward)."""
    if p.ep <= 1:
        return 0
    fwd, bwd = ep_layer_bytes(m, tokens, act)
    again = fwd if p.act_ckpt == "block" else 0
    return moe_layer_count(m, range(m.n_layers)) * (fwd + bwd + again)


def ep_micro_calls(m: ModelConfig, p: ParallelConfig) -> int:
    if p.ep <= 1:
        return 0
    fwd, bwd = ep_layer_calls()
    again = fwd if p.act_ckpt == "block" else 0
    return moe_layer_count(m, range(m.n_layers)) * (fwd + bwd + again)


def dp_rep(p: ParallelConfig) -> int:
    """Ranks holding the same expert shard (``dp / ep``)."""
    return p.dp // p.ep if p.ep > 1 else 1


def expert_grad_bytes(p: ParallelConfig, expert_elements: int) -> int:
    """``reduce_expert_grads``' all-reduce over dp_rep, once per step (fp32 gradients)."""
    return FP32 * expert_elements if p.ep > 1 and dp_rep(p) > 1 else 0


def buffer_bytes(m: ModelConfig, layers: range) -> int:
    """The routers' buffers: the balance bias (fp32, ``bias`` only) and the load (int64)."""
    per = m.moe_experts * (COUNT_BYTES + (FP32 if m.moe_balance == "bias" else 0))
    return per * moe_layer_count(m, layers)


def expert_rows(m: ModelConfig, tokens: int, ep: int) -> int:
    """Rows one local expert runs on, under balanced routing: the ``T·k`` copies a rank
    receives spread over its ``E/ep`` experts."""
    return max(1, tokens * m.moe_top_k * ep // m.moe_experts)


# Kernels an MoE layer launches besides its GEMMs (an estimate, as gemms.block_kernels'):
# routing (scores, top-k, sort, counts, gather, weighting, index_add) per layer, and per local
# expert its product and σ; forward, backward.
ROUTING_KERNELS = (16, 14)
EXPERT_KERNELS = (4, 8)


def moe_kernels(m: ModelConfig, ep: int) -> tuple[int, int]:
    """(forward, backward) non-GEMM kernels of one MoE layer's experts and routing."""
    experts = m.moe_experts // max(1, ep) + m.moe_shared
    return (
        ROUTING_KERNELS[0] + EXPERT_KERNELS[0] * experts,
        ROUTING_KERNELS[1] + EXPERT_KERNELS[1] * experts,
    )


def routing_passes(m: ModelConfig) -> tuple[int, int]:
    """(forward, backward) element passes per token of the routing, beyond the experts'
    own: scores over E (sigmoid or softmax, top-k, normalising) and each routed copy's
    gather, weighting and index_add on the dispatch and combine widths (unit bytes)."""
    w_d, _, w_c, _ = routed_widths(m, 1)
    k, e = m.moe_top_k, m.moe_experts
    return 6 * e + k * (2 * w_d + 5 * w_c), 4 * e + k * (2 * w_d + 6 * w_c)


def expert_params(m: ModelConfig) -> int:
    """Parameters of one routed expert: B_g, B_u, A_d (latent), or a whole MLP (hidden)."""
    d, r, f = m.dim, m.rank or 0, m.moe_ffn_dim or 0
    if latent_dispatch(m):
        return 3 * r * f
    return 3 * ((d + f) * r if m.lowrank else d * f)


def expert_weight_casts(m: ModelConfig, act: int, ep: int, dp: int) -> int:
    """Bytes of the routed experts' bf16 weight copies one MoE layer's forward keeps.

    Each expert's GEMMs read their weight through ``models.params.local``, which under
    autocast casts that expert's row of the local ``[E/ep, ...]`` stack; its GEMMs keep the
    copy until the backward: one bf16 copy of the stack per layer, wherever the weights are
    not already bf16 (at ``ep > 1`` FSDP does not gather them). At dp 1 nothing gathers and
    ``bf16_weights`` already counts that copy; at ``ep = 1`` under FSDP its mixed precision
    hands them over in bf16: no cast.
    """
    if act >= FP32 or ep == 1:
        return 0
    return act * (m.moe_experts // ep) * expert_params(m)


def expert_weights_per_layer(m: ModelConfig) -> int:
    """Stacked routed-expert weights of one MoE layer (one all-reduce each over dp_rep)."""
    return 6 if not latent_dispatch(m) and m.lowrank else 3


def dense_mlp_activation(m: ModelConfig, tokens: int, act: int) -> float:
    """What ``memory.activation_bytes_per_block`` counts for a dense MLP on the
    single-device block without recompute: its products, and under a low-rank arch each
    linear's A and σ outputs (and LaX's crossing latent)."""
    T, r = tokens, m.rank or 0
    out = (4 if m.mlp_form == "swiglu" else 3) * T * m.ffn_dim * act
    if m.lowrank:
        out += 3 * (2 + (1 if arch_spec(m.arch).crossing else 0)) * T * r * act
    return float(out)


def moe_mlp_activation(m: ModelConfig, tokens: int, act: int, ep: int = 1, dp: int = 1) -> float:
    """Bytes autograd keeps for one MoE MLP and micro-batch of ``tokens`` on one rank
    (an estimate, by the tensors its operators save), receiving ``T·k`` copies (balanced
    routing; at ep 1 exactly so).

    The router: fp32 scores over E (three ``[T, E]``: scores, normalised, the balance
    loss's), the top-k indices and weights and the copies' order. ``latent``: A_g's and
    A_u's outputs (σ's inputs; LaX: its crossing too), each copy's ``2r`` input at its
    expert, the expert's products over ``f_e`` and ``A_d``'s output, each copy's ``r``-wide
    result twice (kept by the weighting; the weighted one by the summing ``index_add``) and
    B_d's input. ``hidden``: each copy's d-wide input (in the compute dtype), per linear A's
    and σ's outputs, the products, the d-wide result per copy twice. Shared experts: the
    same on every token. Under bf16 autocast (``act`` 2) also the router's input, kept in
    bf16 (a cast of the norm's fp32 output, which the dense block keeps only as its GEMM
    cast), under ``latent`` a second cast of it (A_g and A_u are two GEMMs, the dense
    block's grouped one), and the routed experts' weight casts (:func:`expert_weight_casts`).
    """
    T, k, r, f, d = tokens, m.moe_top_k, m.rank or 0, m.moe_ffn_dim or 0, m.dim
    copies, s = T * k, m.moe_shared
    prod = 4 if m.mlp_form == "swiglu" else 3
    sigma = 1 if arch_spec(m.arch).latent_activation else 0
    out = 3 * T * m.moe_experts * FP32 + copies * (2 * COUNT_BYTES + 2 * FP32)
    if act < FP32:
        out += T * d * act + (T * d * act if latent_dispatch(m) else 0)
        out += expert_weight_casts(m, act, ep, dp)
    if latent_dispatch(m):
        cross = 2 * T * r * act if arch_spec(m.arch).crossing else 0
        out += 2 * T * r * act * sigma + cross + (2 * T * r * act if s else 0)
        per_row = (f * prod + r * sigma) * act
        out += copies * (2 * r * act + per_row + 2 * r * act) + s * T * per_row + T * r * act
        return float(out)
    lat = 3 * r * (1 + sigma) if m.lowrank else 0
    per_row = (f * prod + lat) * act
    out += copies * (d * act + per_row + 2 * d * act) + s * T * per_row
    if s and act < FP32:  # the token's bf16 cast, which the shared experts' GEMMs keep
        out += T * d * act
    return float(out)


def moe_summary(m: ModelConfig, p: ParallelConfig, ep_bytes: int) -> dict[str, object]:
    """An MoE prediction's routing figures (``boostlr plan``'s ``moe`` field and columns)."""
    return {
        "experts": m.moe_experts,
        "top_k": m.moe_top_k,
        "shared": m.moe_shared,
        "ffn_dim": m.moe_ffn_dim,
        "dispatch": moe_dispatch_of(m),
        "ep": p.ep,
        "elements_per_copy": elements_per_copy(m),
        "ep_bytes_per_step": ep_bytes,
        "routing": "balanced (a rank's ep bytes and expert activations assume T·k/E copies "
        "per expert; exact over an ep group whatever the routing)",
    }
