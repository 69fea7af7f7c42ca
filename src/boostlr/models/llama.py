"""The LLaMA-2 decoder for every arch (``full``, ``cola``, ``svd``, ``lax``).

Module and parameter names follow HF ``LlamaForCausalLM`` (``embed_tokens``,
``layers.{i}.self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``norm``,
``lm_head``) so export is a renaming of the prefix, never a reshuffle. The math that the
tensor-parallel strategies share with the single-device model lives in module-level
functions (:func:`causal_attention`, :func:`rope_tables`) so a sharded block calls the same
code on its slice of heads. The block's MLP is pluggable: :func:`~boostlr.models.mlp.make_mlp`
builds it and the strategies act on it through its roles (:mod:`boostlr.models.mlp`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from boostlr.config import ModelConfig
from boostlr.models.init import initial_value
from boostlr.models.lowrank import make_linear
from boostlr.models.mlp import Latents, make_mlp
from boostlr.models.norm import RMSNorm
from boostlr.models.params import local
from boostlr.models.shapes import ATTN_LINEARS, MLP_LINEARS, linear_shapes  # noqa: F401

# SDPA's ``enable_gqa`` (torch 2.5+): grouped K/V heads without ``repeat_interleave``.
SDPA_GQA = TorchVersion(torch.__version__) >= (2, 5)
# Of CUDA's fused kernels only flash attention takes ``enable_gqa``, and only in half
# precision; fp32 would fall back to the unfused math kernel, slower than memory-efficient
# attention on copied K/V. (CPU's flash kernel takes it in both; fp32 keeps the copies.)
_GQA_DTYPES = (torch.bfloat16, torch.float16)


def gqa_in_kernel(q: torch.Tensor) -> bool:
    """Whether SDPA reads grouped K/V heads itself for queries like ``q`` (no copies)."""
    return SDPA_GQA and q.dtype in _GQA_DTYPES


# ----------------------------------------------------------------------------- shared math


def rope_tables(
    cfg: ModelConfig, seq_len: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin ``[seq_len, head_dim]`` for HF's ``rotate_half`` layout (halves).

    HF computes ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]``; the sign
    is folded into the table (``[-sin, sin]``) so each layer's rotation is one roll, not a
    negation and a concatenation.
    """
    hd = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
    )
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, hd]`` by position (``sin`` signed, see :func:`rope_tables`)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    head_dim: int,
) -> torch.Tensor:
    """Causal GQA attention on ``[b, s, heads*hd]`` projections; head counts come from shapes.

    Tensor-parallel strategies call this with their local slice of heads.
    """
    b, s, _ = q.shape
    q = q.view(b, s, -1, head_dim).transpose(1, 2)
    k = k.view(b, s, -1, head_dim).transpose(1, 2)
    v = v.view(b, s, -1, head_dim).transpose(1, 2)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif gqa_in_kernel(q):  # each query group reads its K/V head in place: no copies
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


# ----------------------------------------------------------------------------- modules


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | str | None):
        super().__init__()
        self.head_dim = cfg.head_dim
        for name, (d_in, d_out) in linear_shapes(cfg).items():
            if name in ATTN_LINEARS:
                setattr(self, name, make_linear(cfg, d_in, d_out, layer, device))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], z_prev: Latents | None
    ) -> tuple[torch.Tensor, Latents]:
        z: Latents = {}
        q, z["q_proj"] = self.q_proj(x, _get(z_prev, "q_proj"))
        k, z["k_proj"] = self.k_proj(x, _get(z_prev, "k_proj"))
        v, z["v_proj"] = self.v_proj(x, _get(z_prev, "v_proj"))
        out = causal_attention(q, k, v, rope, self.head_dim)
        y, z["o_proj"] = self.o_proj(out, _get(z_prev, "o_proj"))
        return y, z


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | str | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.self_attn = Attention(cfg, layer, device)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.mlp = make_mlp(cfg, layer, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        z_prev: Latents | None,
        impl: Callable[..., tuple[torch.Tensor, Latents | None]] | None = None,
    ) -> tuple[torch.Tensor, Latents | None]:
        """``impl(block, x, rope, z_prev)`` runs a strategy's per-rank form of this block.

        Going through the module call either way keeps module hooks around the block (FSDP's
        parameter all-gather and gradient reduce-scatter are such hooks).
        """
        if impl is not None:
            return impl(self, x, rope, z_prev)
        return self.compute(x, rope, z_prev)

    def compute(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], z_prev: Latents | None
    ) -> tuple[torch.Tensor, Latents]:
        """The single-device math."""
        a, z_attn = self.self_attn(self.input_layernorm(x), rope, z_prev)
        x = x + a
        m, z_mlp = self.mlp(self.post_attention_layernorm(x), z_prev)
        return x + m, {**z_attn, **z_mlp}


class Embedding(nn.Embedding):
    """Token embedding whose forward can run a strategy's per-rank form, as :class:`Block`'s.

    Called as a module either way, so FSDP can make it a unit of its own: gathered only for
    the lookup and for its gradient at the very end of the backward.
    """

    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, impl: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        if impl is not None:
            return impl(self, tokens)
        # The residual stream is fp32 whatever the rows were looked up in (docs/precision.md).
        return F.embedding(tokens, local(self.weight)).float()


class LMHead(nn.Linear):
    """The LM head, called as a module for the same reason as :class:`Embedding`: as its own
    FSDP unit its full gradient is reduced, and the gathered weight freed, as soon as its
    backward ends instead of after the whole stage's."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, impl: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        if impl is not None:
            return impl(self, x)
        return F.linear(x, local(self.weight))


class LlamaModel(nn.Module):
    """Decoder-only LM. ``forward(tokens)`` gives logits; with ``targets`` the mean CE loss.

    ``layers`` is keyed by the global layer index, so a pipeline stage that keeps only some
    layers (and the embedding only on the first stage, norm and head only on the last) still
    names every parameter as the single-device model does.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device | str | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("model vocab_size must be set (from the dataset) before building")
        self.cfg = cfg
        layers = range(cfg.n_layers) if layers is None else layers
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim, device=device) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, device) for i in layers})
        if last:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
            self.lm_head = LMHead(cfg.dim, cfg.vocab_size, bias=False, device=device)
        else:
            self.norm = self.lm_head = None
        if cfg.tie_embeddings and first and last:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def last(self) -> bool:
        return self.lm_head is not None

    def init_weights(self, seed: int) -> None:
        """Each parameter from its own ``(seed, name)`` generator: layout-independent."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(initial_value(self.cfg, name, p.shape, seed))

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head on the residual stream; with ``targets`` the mean CE loss."""
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        rope = rope_tables(self.cfg, tokens.shape[1], device=tokens.device)
        z: Latents | None = None
        for block in self.layers.values():
            x, z = block(x, rope, z)
        return self.head(x, targets)


def build_model(
    cfg: ModelConfig, seed: int = 0, device: torch.device | str | None = None
) -> LlamaModel:
    """Build on ``device``; real devices get the seeded init, ``meta`` stays uninitialised."""
    if device is not None and torch.device(device).type == "meta":
        return LlamaModel(cfg, device="meta")
    model = LlamaModel(cfg, device="cpu")
    model.init_weights(seed)
    return model.to(device) if device is not None else model


def _get(z: Latents | None, name: str) -> torch.Tensor | None:
    return None if z is None else z.get(name)
