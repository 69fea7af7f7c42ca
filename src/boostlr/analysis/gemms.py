"""What one tensor-parallel rank runs per block: GEMMs, element-wise traffic, kernel launches.

Shapes follow the strategies' code (``parallel/megatron.py``, ``vanilla.py``, ``btp.py``,
``single.py``): a GEMM ``[M, K] @ [K, N]`` with ``K`` the reduction dim. Vanilla TP's B has
``K = r/t`` (memory-bound: the paper's point); BTP's A has ``K = d/t`` and writes the full
``r``; vanilla runs attention on every head of the replicated q/k/v.

Everything else a block runs is read from the code, forward and backward: the bytes its
element-wise kernels move (norms, RoPE, σ, products, residual adds, the collectives' copies,
BTP's concatenations: :func:`block_elementwise`), over the memory bandwidth, and an estimate
of how many kernels it launches besides the GEMMs (:func:`block_kernels`). Only shapes from
:mod:`boostlr.models.shapes` and the config are read: nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boostlr.analysis.moe import (
    expert_rows,
    latent_dispatch,
    moe_kernels,
    routing_passes,
)
from boostlr.config import ModelConfig
from boostlr.models.shapes import MLP_LINEARS, linear_shapes
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe_layer
from boostlr.specs.strategy import BlockShape, StrategySpec, Traffic, spec_or_none

FP32 = 4


@dataclass(frozen=True)
class Gemm:
    """``count`` identical GEMMs ``[m, k] @ [k, n]``; ``scale`` < 1 for causal masking."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1
    scale: float = 1.0
    kind: str = "linear"  # "linear" (weights) | "attention" (flash kernel)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count * self.scale

    def bytes(self, elem: int) -> float:
        """Operands read and result written once (the roofline's memory traffic)."""
        return float(self.m * self.k + self.k * self.n + self.m * self.n) * self.count * elem

    def intensity(self, elem: int) -> float:
        return self.flops / self.bytes(elem)


def backward(g: Gemm) -> list[Gemm]:
    """The backward GEMMs of a forward GEMM.

    A linear needs the input grad ``[m, n] @ [n, k]`` and the weight grad ``[k, m] @ [m, n]``;
    flash attention's backward recomputes the scores and runs four more products, i.e. 2.5x
    the forward (the two forward GEMMs become five).
    """
    if g.kind == "attention":
        return [Gemm(f"{g.name}.bwd", g.m, g.k, g.n, g.count, g.scale * 2.5, "attention")]
    return [
        Gemm(f"{g.name}.dgrad", g.m, g.n, g.k, g.count, g.scale),
        Gemm(f"{g.name}.wgrad", g.k, g.m, g.n, g.count, g.scale),
    ]


def _lowrank(name: str, tokens: int, d_in: int, d_out: int, r: int) -> list[Gemm]:
    return [Gemm(f"{name}.A", tokens, d_in, r), Gemm(f"{name}.B", tokens, r, d_out)]


def _lax_gates(cfg: ModelConfig, tokens: int, layer: int, names: tuple[str, ...]) -> list[Gemm]:
    """LaX crossings on replicated ``[T, r]`` latents (every rank computes them whole)."""
    if not arch_spec(cfg.arch).crossing or layer == 0:
        return []
    r, gr = cfg.rank, cfg.lax_gate_rank
    out = []
    for n in names:
        if cfg.lax_gate == "full":
            out.append(Gemm(f"{n}.G", tokens, r, r))
        else:
            out += [Gemm(f"{n}.G_down", tokens, r, gr), Gemm(f"{n}.G_up", tokens, gr, r)]
    return out


def attention_gemms(cfg: ModelConfig, batch: int, seq: int, heads: int) -> list[Gemm]:
    """Scores and weighted values of ``heads`` heads; causal flash kernels skip half."""
    hd, bh = cfg.head_dim, batch * heads
    return [
        Gemm("attn.qk", seq, hd, seq, bh, 0.5, "attention"),
        Gemm("attn.pv", seq, seq, hd, bh, 0.5, "attention"),
    ]


def block_gemms(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    batch: int,
    seq: int,
    layer: int = 1,
    grouping: bool = True,
    ep: int = 1,
) -> list[Gemm]:
    """Forward GEMMs of one block on one TP rank for ``batch`` sequences of ``seq`` tokens
    (an MoE block's on one of ``ep`` expert-parallel ranks)."""
    if is_moe_layer(cfg, layer):
        dense = block_gemms(replace(cfg, moe_experts=0), strategy, tp, batch, seq, layer, grouping)
        t = tp if strategy else 1
        return [g for g in dense if _outside_moe(cfg, g.name)] + moe_gemms(cfg, batch * seq, ep, t)
    T, t = batch * seq, tp
    shapes = linear_shapes(cfg)
    names = tuple(shapes)
    out: list[Gemm] = []
    s = spec_or_none(strategy)
    if not arch_spec(cfg.arch).lowrank:
        # Megatron: q/k/v/gate/up split their output, o/down their input (tp 1: whole).
        for n, (d_in, d_out) in shapes.items():
            col = n not in ("o_proj", "down_proj")
            out.append(Gemm(n, T, d_in, d_out // t) if col else Gemm(n, T, d_in // t, d_out))
        return out + attention_gemms(cfg, batch, seq, cfg.n_heads // t)
    r = cfg.rank
    if s is None or s.splits_rank:
        rt = r // t  # vanilla splits r (tp 1: the plain model)
        for n, (d_in, d_out) in shapes.items():
            out += _lowrank(n, T, d_in, d_out, rt)
        # Vanilla all-reduces q/k/v to full width: every rank runs every head.
        out += _lax_gates(cfg, T, layer, names)
        return out + attention_gemms(cfg, batch, seq, cfg.n_heads)
    if not s.bottleneck_regions:
        raise ValueError(f"strategy {strategy!r} does not apply to arch {cfg.arch}")
    d, kv, f = cfg.dim // t, cfg.kv_dim // t, cfg.ffn_dim // t
    if grouping:
        out += [Gemm("qkv.A", T, d, 3 * r), Gemm("gate_up.A", T, d, 2 * r)]
        if cfg.n_kv_heads == cfg.n_heads:
            out.append(Gemm("qkv.B", T, r, d, 3))
        else:  # under GQA only k and v share a shape
            out += [Gemm("q_proj.B", T, r, d), Gemm("kv.B", T, r, kv, 2)]
        out.append(Gemm("gate_up.B", T, r, f, 2))
    else:
        out += [Gemm(f"{n}.A", T, d, r) for n in ("q_proj", "k_proj", "v_proj")]
        out += [Gemm(f"{n}.A", T, d, r) for n in ("gate_proj", "up_proj")]
        out += [Gemm("q_proj.B", T, r, d), Gemm("k_proj.B", T, r, kv), Gemm("v_proj.B", T, r, kv)]
        out += [Gemm("gate_proj.B", T, r, f), Gemm("up_proj.B", T, r, f)]
    out += [Gemm("o_proj.A", T, d, r), Gemm("o_proj.B", T, r, d)]
    out += [Gemm("down_proj.A", T, f, r), Gemm("down_proj.B", T, r, d)]
    out += _lax_gates(cfg, T, layer, names)
    return out + attention_gemms(cfg, batch, seq, cfg.n_heads // t)


def _outside_moe(cfg: ModelConfig, name: str) -> bool:
    """Whether a dense block's GEMM stays in an MoE block: attention, and under ``latent``
    the LaX crossings of the shared in-factors (gate, up)."""
    linear, _, part = name.partition(".")
    if linear not in MLP_LINEARS:
        return True
    return latent_dispatch(cfg) and part.startswith("G") and linear != "down_proj"


def moe_gemms(cfg: ModelConfig, tokens: int, ep: int = 1, tp: int = 1) -> list[Gemm]:
    """An MoE MLP's forward GEMMs on one rank: the router, the shared outer factors
    (``latent``), each local routed expert on its balanced share of the copies
    (:func:`~boostlr.analysis.moe.expert_rows`), and the shared experts on every token.
    Under BTP (``tp > 1``) the router and the outer factors read or write the rank's
    ``d / tp`` slice, and the experts run on its ``T / tp`` share of the tokens."""
    T, r, f = tokens, cfg.rank or 0, cfg.moe_ffn_dim or 0
    d = cfg.dim // tp
    share = T // tp
    n, s, rows = cfg.moe_experts // ep, cfg.moe_shared, expert_rows(cfg, share, ep)
    out = [Gemm("router", T, d, cfg.moe_experts)]
    if latent_dispatch(cfg):
        out += [Gemm("moe.A_gate_up", T, d, r, 2), Gemm("moe.B_down", T, r, d)]
        out += [Gemm("experts.B_gate_up", rows, r, f, 2 * n), Gemm("experts.A_down", rows, f, r, n)]
        if s:
            out += [
                Gemm("shared.B_gate_up", share, r, f, 2 * s),
                Gemm("shared.A_down", share, f, r, s),
            ]
        return out
    for name, m, count in (("experts", rows, n), ("shared", T, s)):
        if not count:
            continue
        if cfg.lowrank:
            out += [Gemm(f"{name}.gate_up.A", m, d, r, 2 * count)]
            out += [Gemm(f"{name}.gate_up.B", m, r, f, 2 * count)]
            out += [Gemm(f"{name}.down.A", m, f, r, count), Gemm(f"{name}.down.B", m, r, d, count)]
        else:
            out += [Gemm(f"{name}.gate_up", m, d, f, 2 * count)]
            out += [Gemm(f"{name}.down", m, f, d, count)]
    return out


def head_gemms(cfg: ModelConfig, strategy: str | None, tp: int, tokens: int) -> list[Gemm]:
    """The LM head: vocabulary-parallel under every TP strategy (``ceil(V/t)`` rows)."""
    t = tp if strategy else 1
    return [Gemm("lm_head", tokens, cfg.dim, -(-cfg.vocab_size // t))]


# ----------------------------------------------------------------------------- element-wise

# Element passes of the strategies' non-GEMM kernels, per token and per element of the width
# they act on: a binary op reads two operands and writes one (3), a unary op 2, a reduction
# 1 (plus its small result). Read from the code's ops (``benchmarks/census.py`` compares the
# totals with what torch dispatches on a CPU).
NORM = (7, 24)  # rms_norm: pow, mean, x * rsqrt, gain * x; backward: 14 kernels
PRODUCT = (3, 6)  # g * u
SWIGLU = (5, 9)  # silu(g) * u
RESIDUAL = 3  # x + y (its backward passes the gradient through)
REUSE = 3  # backward: one more consumer of a tensor adds its gradient (g1 + g2)
CLONE = 2  # a collective's copy of its payload into a fresh buffer (read + write)
# Each latent's own passes (σ, LaX's crossing) are its arch's: ``ArchSpec.latent_passes``.


@dataclass(frozen=True)
class ElementWise:
    """Non-GEMM work of one rank: bytes moved forward and backward."""

    fwd: float = 0.0
    bwd: float = 0.0

    def __add__(self, o: ElementWise) -> ElementWise:
        return ElementWise(self.fwd + o.fwd, self.bwd + o.bwd)


def _attention_passes(q: int, kv: int) -> tuple[int, int]:
    """RoPE on q and k (``x cos + roll(x) sin``), GQA's repeat of k and v, the backward's
    copies of SDPA's transposed gradients (SDPA itself is costed as attention GEMMs)."""
    gqa = kv < q
    fwd = 9 * (q + kv) + (4 * q if gqa else 0)
    bwd = 9 * (q + kv) + 4 * q + (2 * (q + kv) if gqa else 0)
    return fwd, bwd


def _bottleneck_block(s: StrategySpec | None, lowrank: bool, grouping: bool) -> bool:
    """Whether BTP's block runs: under BTP, or on one device for a grouped low-rank model."""
    return s.bottleneck_regions if s else lowrank and grouping


def _collectives(cfg: ModelConfig, s: StrategySpec, tokens: int, act: int) -> Traffic:
    """The strategy's block traffic without crossing latents (what its own regions send)."""
    shape = BlockShape(tokens, cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.rank or 0, act)
    return s.block_traffic(shape, True, "online")


def block_elementwise(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    tokens: int,
    act: int,
    layer: int = 1,
    grouping: bool = True,
    overlap: bool = True,
) -> ElementWise:
    """Non-GEMM traffic of one block on one TP rank, forward and backward.

    Element passes per token (the constants above) times ``act`` bytes per element (under
    bf16 autocast 2: the norms' fp32 internals and autocast's casts are not modelled). An
    MoE block counts its experts' products as a dense MLP of the width a token uses
    (``(top_k + shared) · f_e``), plus the routing's passes.
    """
    if is_moe_layer(cfg, layer):
        used = (cfg.moe_top_k + cfg.moe_shared) * (cfg.moe_ffn_dim or 0)
        dense = replace(cfg, moe_experts=0, ffn_dim=used)
        ew = block_elementwise(dense, strategy, tp, tokens, act, layer, grouping, overlap)
        rf, rb = routing_passes(cfg)
        return ew + ElementWise(rf * tokens * act, rb * tokens * act)
    t = tp if strategy else 1
    s, arch = spec_or_none(strategy), arch_spec(cfg.arch)
    if _bottleneck_block(s, cfg.lowrank, grouping):
        return _btp_elementwise(cfg, t, tokens, act, layer, grouping, overlap)
    d, kv, f, r = cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.rank or 0
    mlp_f, mlp_b = SWIGLU if cfg.mlp_form == "swiglu" else PRODUCT
    lat_f, lat_b = arch.passes(layer)
    w = 1 if s is None or s.replicates_heads else t  # vanilla replicates heads and f
    q, k, ff = d // w, kv // w, f // w
    att_f, att_b = _attention_passes(q, k)
    fwd = 2 * NORM[0] * d + att_f + mlp_f * ff + 2 * RESIDUAL * d
    bwd = 2 * NORM[1] * d + att_b + mlp_b * ff
    # The residual stream feeds a norm and an add; the norm's output feeds 3 (q, k, v) and
    # 2 (gate, up) linears: each extra consumer adds a gradient in the backward.
    bwd += REUSE * (2 * d + 2 * d + d)
    if s is not None and t > 1:
        # Each collective copies its payload first (megatron: o and down forward, attn_in
        # and mlp_in backward; vanilla: every B's output forward, the four regions' input
        # grads backward).
        sent = _collectives(cfg, s, 1, 1)
        fwd += CLONE * sent.fwd
        bwd += CLONE * sent.bwd
    if cfg.lowrank:
        rl = s.latent_width(r, t) if s else r  # vanilla splits r
        r_lat = r if arch.crossing else rl  # LaX's crossing needs all of r
        fwd += lat_f * 7 * r_lat
        bwd += lat_b * 7 * r_lat
        if s is not None and t > 1 and s.gathers_latents(arch):
            per = r + CLONE * r + CLONE * rl  # gathered to all of r and re-split, both ways
            fwd, bwd = fwd + 7 * per, bwd + 7 * per
    return ElementWise(fwd * tokens * act, bwd * tokens * act)


def _btp_elementwise(
    cfg: ModelConfig, t: int, tokens: int, act: int, layer: int, grouping: bool, overlap: bool
) -> ElementWise:
    """BTP's block (``parallel/btp.py``) on a d-sharded residual; ``t = 1``: one device.
    With ``overlap`` at TP > 1 the grouped up-projection's backward also concatenates the
    input gradients it sends off."""
    sends = overlap and grouping and t > 1
    d, kv, f, r = cfg.dim // t, cfg.kv_dim // t, cfg.ffn_dim // t, cfg.rank
    mlp_f, mlp_b = SWIGLU if cfg.mlp_form == "swiglu" else PRODUCT
    lat_f, lat_b = arch_spec(cfg.arch).passes(layer)
    att_f, att_b = _attention_passes(d, kv)
    groups = 3 + 2  # down-projections sharing an input: q, k, v and gate, up
    whole = t == 1
    fwd = 2 * RESIDUAL * d + att_f + mlp_f * f + lat_f * 7 * r
    bwd = att_b + mlp_b * f + lat_b * 7 * r
    if whole:  # the plain norms; the residual feeds a norm and an add
        fwd += 2 * NORM[0] * d
        bwd += 2 * NORM[1] * d + 2 * REUSE * d
        if not grouping:  # the norm's output feeds 3 and 2 linears
            bwd += REUSE * 3 * d
    else:
        # Norm folded into the down-projections: pow, sum, x / rms_loc, gain * x (the
        # residual feeding pow, the division and the add); each partial rescaled by rms_loc,
        # [p | ss] concatenated, copied by the all-reduce, rescaled by 1/rms. Backward:
        # those in reverse, the concatenation's split undone by a concatenation.
        fwd += 2 * 7 * d + (2 + 2 + CLONE + 2) * r * groups
        bwd += 2 * (15 + 2 * REUSE) * d + (2 + 6 + 2) * r * groups
        fwd += CLONE * 2 * r  # the o and down all-reduce copies
        bwd += CLONE * 7 * r  # each latent's input grad all-reduced on entering a region
    if grouping:
        # The grouped down-projection's output split (backward: concatenated), the latents
        # concatenated to enter their region and split there (backward: the reverse).
        fwd += 2 * r * groups
        bwd += (2 + 2) * r * groups if not whole else 2 * 2 * r * groups
        # Same-shaped up-projections stacked for one bmm (inputs [T, r] each); the gradients
        # of the unbound outputs stacked in the backward.
        qkv = [d, kv, kv] if kv == d else [kv, kv]
        fwd += 2 * r * (len(qkv) + 2)
        bwd += 2 * 5 * r if sends else 0
    ew = ElementWise(fwd * tokens * act, bwd * tokens * act)
    if grouping:  # weights concatenated / stacked every step (fp32); the backward
        # concatenates the A's again (only the weights themselves are saved)
        qkv = [d, kv, kv] if kv == d else [kv, kv]
        cat = 2 * r * (cfg.dim // t) * groups  # [A_q; A_k; A_v], [A_gate; A_up]
        stacked = r * (sum(qkv) + 2 * f)  # B_q, B_k, B_v / B_gate, B_up
        ew = ew + ElementWise((cat + 2 * stacked) * FP32, cat * FP32)
    return ew


# The step's parts outside the blocks, per token: the embedding (vocab-parallel: masked
# lookup and its all-reduce copy; BTP: a local lookup of the d-slice), the final norm and the
# cross-entropy over the rank's ``v`` logits: max, subtract, exp, sum and the saved softmax
# (vocab-parallel, 8 passes) or log-softmax (one device, 2); backward 4 passes over the
# logits, the embedding's dense gradient (the whole table slice written).
CE_VOCAB_PARALLEL = (8, 4)
CE_LOCAL = (2, 4)
# The fused head + loss (parallel/head_loss.py), fp32 bytes per logit of the rank's v: the
# chunk's log-softmax and exp (4 passes), vocabulary-parallel also the row max and the rescale
# to the global softmax (3 more); its backward writes the two d-wide input gradients.
CE_FUSED_LOGIT = (16, 28)
CE_FUSED_BWD = 16


ROPE_TABLES = 8.5  # cos and sin tables per forward: passes over [seq, head_dim] (fp32)


def head_elementwise(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    tokens: int,
    act: int,
    seq: int = 0,
    fused: bool = True,
) -> ElementWise:
    """Embedding, RoPE tables, final norm and loss on one rank (the LM head is a
    :class:`Gemm`); ``seq`` is the sequence length (the tables' size); ``fused``: the head
    and loss as one step (``train.fused_loss``, a pipeline's last stage included)."""
    t = tp if strategy else 1
    d, v = cfg.dim, -(-cfg.vocab_size // t)
    norm_f, norm_b = NORM
    fused_f = fused_b = 0  # bytes per token
    if fused:  # the loss's work is these bytes, not passes over the logits
        ce_f, ce_b = 0, 0
        fused_f = CE_FUSED_LOGIT[t > 1] * v
        fused_b = CE_FUSED_BWD * d
    else:
        ce_f, ce_b = CE_LOCAL if t == 1 else CE_VOCAB_PARALLEL
    if t == 1:
        fwd, bwd = 2 * d + norm_f * d + ce_f * v, norm_b * d + d + ce_b * v
        table = cfg.vocab_size * d
    elif spec_or_none(strategy).residual_sharded:  # local lookup of d/t; the last hidden
        dl = d // t  # gathered (and its grad reduce-scattered: copies both ways)
        fwd = 2 * dl + CLONE * d + norm_f * d + ce_f * v
        bwd = norm_b * d + CLONE * d + CLONE * dl + dl + ce_b * v
        table = cfg.vocab_size * dl
    else:  # vocab-parallel embedding: mask, lookup, all-reduce copy; head input's grad copy
        fwd = 2 * d + 2 * d + CLONE * d + norm_f * d + ce_f * v
        bwd = norm_b * d + CLONE * d + 2 * d + d + ce_b * v
        table = v * d
    rope = ROPE_TABLES * seq * cfg.head_dim * FP32
    return ElementWise(
        (fwd * act + fused_f) * tokens + rope, (bwd * act + fused_b) * tokens + table * FP32
    )


# ----------------------------------------------------------------------------- kernels

# Kernels a block launches besides its GEMMs, estimated from the code's structure rather than
# counted per code path (an estimate: a GPU charges a launch for each, a few µs, so a count
# off by a few kernels moves a step by well under 1%). Forward, backward per feature:
NORM_KERNELS = (4, 14)  # rms_norm: pow, mean, x * rsqrt, gain * x; autograd's backward
ROPE_KERNELS = (8, 11)  # q and k: x cos + roll(x) sin; the backward's copies of SDPA's grads
GQA_KERNELS = (2, 2)  # k and v repeated to every query head
SWIGLU_KERNELS = (2, 4)  # silu(g) * u
PRODUCT_KERNELS = (1, 2)  # g * u (low-rank-only MLP)
# Each latent's own kernels are its arch's: ``ArchSpec.latent_kernels``.
GROUP_KERNELS = (4, 4)  # BTP per down-projection group: online-norm rescales, cat, split
WEIGHT_CAT_KERNELS = (4, 2)  # grouped A's concatenated and B's stacked per micro-batch


def block_kernels(
    cfg: ModelConfig,
    strategy: str | None,
    tp: int,
    layer: int = 1,
    grouping: bool = True,
    ep: int = 1,
) -> tuple[int, int]:
    """(forward, backward) non-GEMM kernels of one block on one rank (an estimate).

    Two norms, RoPE, the MLP product, two residual adds, each latent's activation, a copy per
    TP collective, and BTP's per-group online-norm work; a tensor feeding several consumers
    adds one gradient per extra consumer in the backward. An MoE block adds its routing and
    each of its experts' kernels (:func:`~boostlr.analysis.moe.moe_kernels`).
    """
    if is_moe_layer(cfg, layer):
        fwd, bwd = block_kernels(replace(cfg, moe_experts=0), strategy, tp, layer, grouping)
        mf, mb = moe_kernels(cfg, ep)
        return fwd + mf, bwd + mb
    t = tp if strategy else 1
    mlp = SWIGLU_KERNELS if cfg.mlp_form == "swiglu" else PRODUCT_KERNELS
    fwd = 2 * NORM_KERNELS[0] + ROPE_KERNELS[0] + mlp[0] + 2
    bwd = 2 * NORM_KERNELS[1] + ROPE_KERNELS[1] + mlp[1] + 5  # residual, q/k/v, gate/up reuse
    if cfg.n_kv_heads < cfg.n_heads:
        fwd, bwd = fwd + GQA_KERNELS[0], bwd + GQA_KERNELS[1]
    s, arch = spec_or_none(strategy), arch_spec(cfg.arch)
    if cfg.lowrank:
        lf, lb = arch.kernels(layer)
        fwd, bwd = fwd + 7 * lf, bwd + 7 * lb
        if _bottleneck_block(s, True, grouping):
            fwd, bwd = fwd + 2 * GROUP_KERNELS[0], bwd + 2 * GROUP_KERNELS[1]
            fwd, bwd = fwd + WEIGHT_CAT_KERNELS[0], bwd + WEIGHT_CAT_KERNELS[1]
    if s is not None and t > 1:  # one copy per collective (the collective: the link's cost)
        calls = _collectives(cfg, s, 1, 1)
        lax = 7 if s.gathers_latents(arch) else 0  # gather + re-split
        fwd, bwd = fwd + calls.calls_fwd + 2 * lax, bwd + calls.calls_bwd + 2 * lax
    return fwd, bwd


# The embedding, RoPE tables, final norm, LM head and loss, per micro-batch: a few dozen
# small kernels, and the fused loss's per-chunk work (one chunk per 64 MiB of fp32 logits,
# the chunk size of parallel/head_loss.py).
HEAD_KERNELS = (40, 25)
CHUNK_KERNELS = (10, 10)
CHUNK_BYTES = 64 * 2**20


def head_kernels(
    cfg: ModelConfig, strategy: str | None, tp: int, tokens: int = 1, fused: bool = True
) -> tuple[int, int]:
    """(forward, backward) non-GEMM kernels outside the blocks, per micro-batch (estimate)."""
    if not fused:
        return HEAD_KERNELS
    t = tp if strategy else 1
    chunks = -(-tokens * -(-cfg.vocab_size // t) * FP32 // CHUNK_BYTES)
    return (
        HEAD_KERNELS[0] + CHUNK_KERNELS[0] * chunks,
        HEAD_KERNELS[1] + CHUNK_KERNELS[1] * chunks,
    )
