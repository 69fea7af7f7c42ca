"""The mixture-of-experts terms of the cost model (docs/moe.md, "Planning"; design notes §9).

An MoE block trains under data parallelism, expert parallelism (``parallel.ep`` ranks carved
out of dp), a pipeline and BTP (latent dispatch); the cost model prices it on the
single-device block, and under BTP by what differs there (:func:`btp_moe_block_extra`,
:func:`tp_summed_grad_elements`, :func:`btp_moe_activation_extra`; each TP rank's share
of the tokens over ep and through the experts). What the facts of an MoE model are (its
blocks, what a routed copy carries, its expert parameters) is :mod:`boostlr.specs.moe`'s;
what differs from a dense block, and is counted here:

* **Traffic over ep.** Per MoE layer and micro-batch, ``dropless_ep`` all-gathers the
  ``[ep, E/ep]`` int64 counts (forward only; every rank needs the whole matrix for the
  receive bound), sends each routed copy out
  (``dispatch``: ``2r`` wide under ``latent``, the d-wide token under ``hidden``) and its
  result back (``combine``: ``r`` or ``d`` wide); the backward runs both in reverse, and a
  checkpointed block's re-forward repeats the forward. The ledger counts each all-to-all's
  whole input, the rank's own chunk included: the dispatch input is the rank's ``T·k``
  copies, the combine input the copies it received. Over an ep group the copies received
  equal the copies sent, so the figures here (``T·k`` received on every rank) are exact for
  the group's mean whatever the routing, and for each rank under balanced routing. A
  capacity at ep > 1 moves every slot (``E · capacity`` rows each way) and no counts.
* **The receive bound.** The memory columns assume balanced routing; :func:`received_rows`
  is the most a rank's experts may run on (``parallel.ep_receive_factor``, a capacity, or
  unbounded) and :func:`moe_summary` the worst rank's memory then.
* **Expert state over dp_rep.** At ``ep > 1`` each ep rank's ``E/ep`` experts are
  shared by the ``dp / ep`` ranks of its ``dp_rep`` group; there they are one FSDP unit per
  MoE layer (``parallel/data_parallel.shard_experts_over_dp``): a rank holds 1/dp of the
  experts' weights, gradients and AdamW state, and the unit's traffic over dp_rep is the
  blocks' rule over dp (gathers in the FSDP dtype, fp32 reduce-scatters). At dp_rep 1
  (``ep = dp``) nothing is replicated and nothing crosses dp_rep.
* **Compute.** Per token the router (``d → E``), ``top_k`` routed and ``moe_shared``
  shared experts, and under ``latent`` the shared outer factors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from boostlr.analysis.comm import fsdp_bytes, fsdp_pipeline_bytes
from boostlr.config import ModelConfig, ParallelConfig
from boostlr.config.validate_moe import dispatch_of, moe_dispatch_of
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import COUNT_BYTES, FP32, balance_spec, moe_layer_count


def latent_dispatch(m: ModelConfig) -> bool:
    """Whether the experts share the outer factors (a copy travels as the latent)."""
    return dispatch_of(m).shared_outer


def routed_widths(m: ModelConfig, act: int) -> tuple[int, int, int, int]:
    """(dispatch elements, their bytes, combine elements, their bytes) per routed copy, as
    the dispatch form's spec states them (:meth:`~boostlr.specs.moe.DispatchSpec.copy_widths`,
    ``copy_bytes``)."""
    spec = dispatch_of(m)
    (out, back), (out_bytes, back_bytes) = spec.copy_widths(m.dim, m.rank), spec.copy_bytes(act)
    return out, out_bytes, back, back_bytes


def elements_per_copy(m: ModelConfig) -> int:
    """Elements one routed copy moves over ep, out and back: 3r (latent) or 2d (hidden)."""
    w_d, _, w_c, _ = routed_widths(m, FP32)
    return w_d + w_c


def capacity_rows(m: ModelConfig, tokens: int) -> int:
    """Slots per (source rank, expert) under a capacity: ``ceil(c · T · k / E)``
    (:func:`boostlr.models.moe_dispatch.capacity_of`, without importing torch)."""
    return max(1, math.ceil(m.moe_capacity * tokens * m.moe_top_k / m.moe_experts))


def ep_layer_bytes(m: ModelConfig, tokens: int, act: int, ep: int = 1) -> tuple[int, int]:
    """(forward, backward) ep bytes of one MoE layer for a micro-batch of ``tokens`` tokens
    on one rank.

    Dropless: the counts all-gathered (``[ep, ep, E/ep]`` int64, the output as the ledger
    counts an all-gather), then the dispatch and combine all-to-alls (whole inputs; the
    combine's and the backward dispatch's are the copies received: ``T·k`` on the group's
    mean). A capacity: no counts, and both all-to-alls move every slot, ``E · capacity``
    rows, whatever the routing."""
    copies = tokens * m.moe_top_k
    w_d, e_d, w_c, e_c = routed_widths(m, act)
    if m.moe_capacity:
        payload = m.moe_experts * capacity_rows(m, tokens) * (w_d * e_d + w_c * e_c)
        return payload, payload
    payload = copies * (w_d * e_d + w_c * e_c)
    return payload + ep * m.moe_experts * COUNT_BYTES, payload


def btp_moe_block_extra(m: ModelConfig, tokens: int, act: int) -> tuple[int, int]:
    """(forward, backward) tp bytes an MoE block under BTP moves beyond a dense BTP block,
    per micro-batch of ``tokens`` tokens (``parallel/btp_moe.py``; the same calls).

    Forward: the router's ``[T, E]`` partial logits ride in the readers' all-reduce; the
    combined ``[T, r]`` results are all-gathered where a dense block all-reduces ``[T, r]``
    (the same bytes). Backward: the latents' and logits' gradients ``[T, 2r + E]`` are
    summed in one fp32 all-reduce (their joint dtype: the normalised latents are fp32)
    where a dense block's readers sum ``[T, 2r]`` in ``act``; the gather's reduce-scatter
    replaces the down-projection's ``[T, r]``."""
    T, r, E = tokens, m.rank or 0, m.moe_experts
    return T * E * act, T * (2 * r + E) * FP32 - 2 * T * r * act


def tp_summed_grad_elements(m: ModelConfig, p: ParallelConfig, layers: range) -> int:
    """Elements of the MoE gradients BTP sums over tp once per step on one rank (dp rank 0:
    FSDP's first chunk is the largest), for the MoE blocks among ``layers``
    (``btp_moe.sum_moe_grads_over_tp``): each router ``[E, d]`` and the shared experts,
    FSDP-sharded over dp; the routed experts, over dp at ep 1, else this ep rank's
    ``E / ep`` sharded over dp_rep."""
    if p.tp <= 1:
        return 0

    def rows(n: int, over: int) -> int:
        return -(-n // over)  # torch.chunk's first chunk, as FSDP2 shards dim 0

    per_expert = expert_params(m)
    routed = rows(m.moe_experts // p.ep, dp_rep(p)) if p.ep > 1 else rows(m.moe_experts, p.dp)
    router = rows(m.moe_experts, p.dp) * m.dim
    per_layer = router + (routed + rows(m.moe_shared, p.dp)) * per_expert
    return moe_layer_count(m, layers) * per_layer


def ep_layer_calls(m: ModelConfig) -> tuple[int, int]:
    """(forward, backward) collectives of one MoE layer and micro-batch: the count
    all-gather (dropless only), dispatch and combine; their two reverses."""
    return (2 if m.moe_capacity else 3), 2


def ep_micro_bytes(m: ModelConfig, p: ParallelConfig, tokens: int, act: int) -> int:
    """One rank's ep bytes for one micro-batch (forward, backward, re-forward); under BTP
    each TP rank dispatches its ``1/tp`` share of the tokens."""
    if p.ep <= 1:
        return 0
    fwd, bwd = ep_layer_bytes(m, tokens // max(1, p.tp), act, p.ep)
    again = fwd if p.act_ckpt == "block" else 0
    return moe_layer_count(m, range(m.n_layers)) * (fwd + bwd + again)


def ep_micro_calls(m: ModelConfig, p: ParallelConfig) -> int:
    if p.ep <= 1:
        return 0
    fwd, bwd = ep_layer_calls(m)
    again = fwd if p.act_ckpt == "block" else 0
    return moe_layer_count(m, range(m.n_layers)) * (fwd + bwd + again)


def dp_rep(p: ParallelConfig) -> int:
    """Ranks holding the same expert shard (``dp / ep``)."""
    return p.dp // p.ep if p.ep > 1 else 1


def expert_grad_bytes(
    p: ParallelConfig,
    units: Sequence[int],
    micro_batches: int,
    pp_microbatches: int,
    param_bytes: int = FP32,
) -> int:
    """One rank's traffic over dp_rep in one step: the expert units' FSDP gathers (in the
    gathered dtype, ``param_bytes``) and fp32 gradient reduce-scatters, by the blocks' rule
    (:func:`boostlr.analysis.comm.fsdp_bytes`; under a pipeline
    :func:`~boostlr.analysis.comm.fsdp_pipeline_bytes`). ``units``: each MoE layer's padded
    expert shard (:attr:`boostlr.analysis.memory.RankParams.expert_units`)."""
    if p.ep <= 1 or dp_rep(p) <= 1:
        return 0
    reshard = p.data_parallel_mode == "fsdp"
    if p.pp > 1:
        args = (dp_rep(p), micro_batches, reshard, pp_microbatches, param_bytes)
        return fsdp_pipeline_bytes(list(units), *args)
    return fsdp_bytes(list(units), dp_rep(p), micro_batches, reshard, param_bytes)


def expert_grad_calls(p: ParallelConfig, units: int, micro_batches: int, pp_mb: int) -> int:
    """The expert units' FSDP collectives in one step (two gathers and a reduce-scatter per
    (pipeline) micro-batch under ``fsdp``; one gather, one reduction per step under ``ddp``),
    as the cost model counts the blocks'."""
    if p.ep <= 1 or dp_rep(p) <= 1:
        return 0
    if p.data_parallel_mode == "fsdp":
        return micro_batches * (pp_mb if p.pp > 1 else 1) * units * 3
    return micro_batches * units * 2


def buffer_bytes(m: ModelConfig, layers: range) -> int:
    """The routers' buffers: the balance bias (fp32, ``bias`` only) and the load (int64)."""
    bias = FP32 if balance_spec(m.moe_balance).selection_bias else 0
    per = m.moe_experts * (COUNT_BYTES + bias)
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
    not already bf16 (at ``ep = dp`` nothing gathers them). At dp 1 nothing gathers and
    ``bf16_weights`` already counts that copy; at ``ep = 1``, and over ``dp_rep > 1`` (the
    experts' own FSDP units), FSDP's mixed precision hands them over in bf16: no cast.
    """
    if act >= FP32 or ep == 1 or dp > ep:
        return 0
    return act * (m.moe_experts // ep) * expert_params(m)


def expert_weights_per_layer(m: ModelConfig) -> int:
    """Stacked routed-expert weights of one MoE layer (one FSDP unit over dp_rep)."""
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


def btp_moe_activation_extra(
    m: ModelConfig, tokens: int, act: int, ep: int, dp: int, tp: int
) -> float:
    """Bytes one MoE block under BTP keeps beyond a dense BTP block, per micro-batch of
    ``tokens`` (an estimate, as :func:`moe_mlp_activation`): the dense block's MLP
    products over ``f / tp`` go; the router's fp32 scores of every token (every TP rank
    routes all of them) and of its share come; the routed copies and shared experts of the
    rank's ``T / tp`` share keep :func:`moe_mlp_activation`'s per-row tensors. The latents
    (replicated) and ``B_d``'s ``[T, r]`` input are what the dense block's are."""
    T, share, k, r, f = tokens, tokens // tp, m.moe_top_k, m.rank or 0, m.moe_ffn_dim or 0
    prod = 4 if m.mlp_form == "swiglu" else 3
    sigma = 1 if arch_spec(m.arch).latent_activation else 0
    copies = share * k
    dense = prod * T * (m.ffn_dim // tp) * act
    out = 3 * (T + share) * m.moe_experts * FP32 + copies * (2 * COUNT_BYTES + 2 * FP32)
    per_row = (f * prod + r * sigma) * act
    out += copies * (2 * r * act + per_row + 2 * r * act) + m.moe_shared * share * per_row
    if act < FP32:
        out += expert_weight_casts(m, act, ep, dp)
    return float(out - dense)


def received_rows(m: ModelConfig, p: ParallelConfig, tokens: int) -> int:
    """The most routed copies one rank's experts run on, per MoE layer and micro-batch of
    ``tokens`` tokens per rank (docs/moe.md, "A bound on what a rank receives").

    ep 1: its own ``T·k``. A capacity: every slot, ``E · ceil(c·T·k/E)`` (about ``c·T·k``).
    Dropless under ``parallel.ep_receive_factor f``: ``ceil(f·T·k)``; unbounded (``f = 0``):
    every rank's copies for its experts, ``ep · T · min(k, E/ep)``."""
    k = m.moe_top_k
    if p.ep <= 1:
        return tokens * k
    if m.moe_capacity:
        return m.moe_experts * capacity_rows(m, tokens)
    if p.ep_receive_factor:
        return math.ceil(p.ep_receive_factor * tokens * k)
    return p.ep * tokens * min(k, m.moe_experts // p.ep)


def received_copy_bytes(m: ModelConfig, act: int) -> int:
    """Bytes autograd keeps per copy a rank's experts run on (the receiving rank's share of
    :func:`moe_mlp_activation`'s per-copy terms): the copy's input at its expert and the
    expert's own tensors (its products over ``f_e``, and σ's or the low-rank factors')."""
    r, f, d = m.rank or 0, m.moe_ffn_dim or 0, m.dim
    prod = 4 if m.mlp_form == "swiglu" else 3
    sigma = 1 if arch_spec(m.arch).latent_activation else 0
    if latent_dispatch(m):
        return 2 * r * act + (f * prod + r * sigma) * act
    lat = 3 * r * (1 + sigma) if m.lowrank else 0
    return d * FP32 + (f * prod + lat) * act


def moe_summary(
    m: ModelConfig,
    p: ParallelConfig,
    ep_bytes: int,
    tokens: int = 0,
    act: int = FP32,
    held_layers: int = 0,
    memory: float = 0.0,
    device_memory: float = 0.0,
) -> dict[str, object]:
    """An MoE prediction's routing figures (``boostlr plan``'s ``moe`` field and columns).

    ``receive``: what one rank's experts may run on per MoE layer and micro-batch (``rows``,
    against ``balanced_rows``, the ``T·k`` the memory columns assume), and the worst rank's
    memory at that bound: ``memory`` (the plan's, balanced) plus the extra rows' tensors
    over the ``held_layers`` MoE layers whose activations are alive at the peak.
    """
    rows, balanced = received_rows(m, p, tokens), tokens * m.moe_top_k
    extra = max(0, rows - balanced) * received_copy_bytes(m, act) * held_layers
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
        "receive": {
            "factor": p.ep_receive_factor if p.ep > 1 and not m.moe_capacity else None,
            "rows": rows,
            "balanced_rows": balanced,
            "extra_bytes": extra,
            "memory_gb_at_bound": (memory + extra) / 1e9,
            "fits_at_bound": memory + extra <= device_memory,
        },
    }
