"""The GEMMs and element-wise traffic one tensor-parallel rank runs per block (DESIGN §2, §5).

Shapes follow the strategies' code (``parallel/megatron.py``, ``vanilla.py``, ``btp.py``,
``single.py``): a GEMM ``[M, K] @ [K, N]`` with ``K`` the reduction dim. Vanilla TP's B has
``K = r/t`` (memory-bound: the paper's point); BTP's A has ``K = d/t`` and writes the full
``r``; vanilla runs attention on every head of the replicated q/k/v. Element-wise traffic is an
estimate (bytes read + written by norms, σ, RoPE, products, residual adds, flash attention's
inputs and outputs); it matters for small shapes and for vanilla's replicated activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.config import ModelConfig
from boostlr.models.llama import linear_shapes

FP32 = 4
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


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
    if cfg.arch != "lax" or layer == 0:
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
) -> list[Gemm]:
    """Forward GEMMs of one block on one TP rank for ``batch`` sequences of ``seq`` tokens."""
    T, t = batch * seq, tp
    shapes = linear_shapes(cfg)
    names = tuple(shapes)
    out: list[Gemm] = []
    if cfg.arch == "full":
        # Megatron: q/k/v/gate/up split their output, o/down their input (tp 1: whole).
        for n, (d_in, d_out) in shapes.items():
            col = n not in ("o_proj", "down_proj")
            out.append(Gemm(n, T, d_in, d_out // t) if col else Gemm(n, T, d_in // t, d_out))
        return out + attention_gemms(cfg, batch, seq, cfg.n_heads // t)
    r = cfg.rank
    if strategy in (None, "vanilla"):
        rt = r // t  # vanilla splits r (tp 1: the plain model)
        for n, (d_in, d_out) in shapes.items():
            out += _lowrank(n, T, d_in, d_out, rt)
        # Vanilla all-reduces q/k/v to full width: every rank runs every head.
        out += _lax_gates(cfg, T, layer, names)
        return out + attention_gemms(cfg, batch, seq, cfg.n_heads)
    if strategy != "btp":
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


def head_gemms(cfg: ModelConfig, strategy: str | None, tp: int, tokens: int) -> list[Gemm]:
    """The LM head: vocabulary-parallel under every TP strategy (``ceil(V/t)`` rows)."""
    t = tp if strategy else 1
    return [Gemm("lm_head", tokens, cfg.dim, -(-cfg.vocab_size // t))]


def block_elementwise_bytes(
    cfg: ModelConfig, strategy: str | None, tp: int, tokens: int, act: int
) -> float:
    """Estimated bytes read + written by one block's non-GEMM forward kernels on one rank.

    ``act``: bytes per activation element (2 under bf16 autocast); the residual stream is fp32.
    """
    T, t = tokens, tp if strategy else 1
    d, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    r = cfg.rank or 0
    if strategy == "btp":
        d_res, d_norm, q, k, ff, lat = d // t, d // t, d // t, kv // t, f // t, r
    elif strategy == "vanilla":  # replicated stream, norms and full-width q/k/v and MLP
        d_res, d_norm, q, k, ff, lat = d, d, d, kv, f, r // t
    else:  # megatron or the plain model
        d_res, d_norm, q, k, ff, lat = d, d, d // t, kv // t, f // t, r
    total = 2 * T * d_norm * (FP32 + act)  # two RMSNorms: read fp32, write act
    total += 2 * 3 * T * d_res * FP32  # two residual adds
    total += 2 * 3 * T * (q + k) * act  # RoPE on q and k (x*cos + rot(x)*sin)
    total += T * (2 * q + 2 * k) * act  # flash attention reads q, k, v, writes out
    total += 3 * T * ff * act  # MLP product (SwiGLU or CoLA's g*u)
    if cfg.lowrank:
        per_latent = {"cola": 2, "svd": 0, "lax": 6}[cfg.arch]  # σ (LaX: norm, add, σ)
        total += 7 * per_latent * T * lat * act
    if strategy == "btp":  # norm statistics and partial-sum rescaling ride in fp32
        total += 2 * T * 3 * r * FP32
    return float(total)


def head_elementwise_bytes(
    cfg: ModelConfig, strategy: str | None, tp: int, tokens: int, act: int
) -> float:
    """Final norm, the logits' fp32 cast and the cross-entropy passes, embedding lookup."""
    t = tp if strategy else 1
    v = -(-cfg.vocab_size // t)
    d_emb = cfg.dim // t if strategy == "btp" else cfg.dim
    return float(tokens * (cfg.dim * (FP32 + act) + v * (act + 3 * FP32) + d_emb * FP32))
