"""Hugging Face model of boostlr's low-rank LLaMA variants (SVD, CoLA, LaX), with KV cache.

Copied into every low-rank or MoE export beside ``configuration_boostlr.py`` and loaded by
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. It imports torch and
transformers only. The math is boostlr's single-device model operation for operation (fp32
RMSNorm, RoPE in the ``rotate_half`` layout with the sign folded into the sin table, SDPA,
GQA by ``repeat_interleave``), so the logits equal ``boostlr``'s own forward; module names
match boostlr's export (``model.layers.{i}.self_attn.q_proj.down.weight``), so the weights
load by name, untouched.

Attention follows transformers' attention interface, so inference engines that plug into it
(vLLM's Transformers backend) run these models: under ``sdpa`` or ``eager`` (transformers'
own choices) the module runs boostlr's SDPA call as before; any other
``config._attn_implementation`` is called once through ``ALL_ATTENTION_FUNCTIONS`` with the
rotated, un-repeated heads. The base model of each arch is a class of its own
(``BoostlrColaModel``, ``AutoModel`` in the export's ``auto_map``), and the configuration
carries a tensor-parallel plan (``base_model_tp_plan``).

Every block linear is ``up(h(down(x)))``: ``h`` is the identity for SVD, SiLU for CoLA, and
for LaX ``SiLU(LN_r(down(x) + G(z_prev)))``, where ``z_prev`` is the latent the same linear
of the previous block produced at the same position. The latent is per position, so cached
decoding only needs it for the new tokens and the KV cache is the usual one.

A mixture-of-experts export adds ``modeling_boostlr_moe.py``, whose model classes subclass
these and give the blocks from ``moe_dense_layers`` on an MoE MLP (the hooks are
``BoostlrDecoderLayer.mlp_for``, ``BoostlrModel.decoder_layer`` and
``BoostlrForCausalLM.inner_model``); a dense export does not carry it. Arch ``full`` (``W x``
linears) is here only for such MoE models: a dense ``full`` model exports as an HF LLaMA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:  # transformers < 4.48 has no attention interface: sdpa only
    ALL_ATTENTION_FUNCTIONS = {}

from .configuration_boostlr import (
    BoostlrColaConfig,
    BoostlrConfig,
    BoostlrLaxConfig,
    BoostlrSvdConfig,
)

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
Latents = dict[str, torch.Tensor]
# transformers 5 renamed the cache field and argument ``past_key_values`` to ``cache``.
_FIELDS = CausalLMOutputWithPast.__dataclass_fields__
CACHE_FIELD = "cache" if "cache" in _FIELDS else "past_key_values"
_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
#: Attention implementations that run boostlr's own SDPA call (bit-identical logits to
#: boostlr's forward); any other goes through ``ALL_ATTENTION_FUNCTIONS``.
OWN_ATTENTION = (None, "sdpa", "eager")
#: Keyword arguments of the model's forward that are not for the attention function.
_MODEL_ONLY_KWARGS = ("return_dict", "output_attentions", "output_hidden_states")


class BoostlrRMSNorm(nn.Module):
    """RMSNorm computed in fp32, as boostlr and ``LlamaRMSNorm`` do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class BoostlrLatentCrossing(nn.Module):
    """LaX's ``LN_r(a + G(z_prev))``; block 0 has the norm but no gate ``G``."""

    def __init__(self, config: BoostlrConfig, gate: str | None):
        super().__init__()
        r = config.rank
        self.norm = BoostlrRMSNorm(r, config.rms_norm_eps)
        self.gate_kind = gate
        if gate == "full":
            self.gate = nn.Linear(r, r, bias=False)
        elif gate == "factored":
            self.gate_down = nn.Linear(r, config.lax_gate_rank, bias=False)
            self.gate_up = nn.Linear(config.lax_gate_rank, r, bias=False)

    def forward(
        self, a: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        u = a
        if self.gate_kind is not None:
            if z_prev is None:
                raise ValueError("a LaX crossing with a gate needs the previous block's latent")
            if self.gate_kind == "full":
                u = u + self.gate(z_prev)
            else:
                u = u + self.gate_up(self.gate_down(z_prev))
        return self.norm(u), u


class BoostlrLowRankLinear(nn.Module):
    """``up(h(down(x)))``; returns the output and LaX's latent (``None`` for SVD and CoLA).

    ``d_out=None`` keeps only ``h(down(x))``: an MoE MLP's shared in-factor (``A_g``, ``A_u``).
    """

    def __init__(self, config: BoostlrConfig, d_in: int, d_out: int | None, layer: int):
        super().__init__()
        self.arch = config.arch
        self.down = nn.Linear(d_in, config.rank, bias=False)
        if d_out is not None:
            self.up = nn.Linear(config.rank, d_out, bias=False)
        if self.arch == "lax":
            self.cross = BoostlrLatentCrossing(config, config.lax_gate if layer > 0 else None)

    def latent(
        self, x: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h(down(x))`` and LaX's latent."""
        a = self.down(x)
        if self.arch == "lax":
            normed, z = self.cross(a, z_prev)
            return F.silu(normed), z
        return (F.silu(a) if self.arch == "cola" else a), None

    def forward(
        self, x: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, z = self.latent(x, z_prev)
        return self.up(h), z


def make_linear(
    config: BoostlrConfig, d_in: int, d_out: int, layer: int
) -> nn.Linear | BoostlrLowRankLinear:
    """The block linear of the config's arch: a plain ``nn.Linear`` for ``full`` (``W x``, MoE
    models only), so that engines replace it with their tensor-parallel linear."""
    if config.arch == "full":
        return nn.Linear(d_in, d_out, bias=False)
    return BoostlrLowRankLinear(config, d_in, d_out, layer)


def project(
    linear: nn.Module, x: torch.Tensor, z_prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block linear on ``x``, and its latent (``None`` but for LaX). A dense linear (or the
    engine's replacement of it) has no latent and takes ``x`` alone."""
    if isinstance(linear, BoostlrLowRankLinear):
        return linear(x, z_prev)
    return linear(x), None


def rope_tables(
    config: BoostlrConfig, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin ``[b, 1, s, head_dim]`` (``[-sin, sin]``: one roll rotates)."""
    hd = config.head_dim
    device = position_ids.device
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
    )
    freqs = position_ids.float()[..., None] * inv_freq
    sin = freqs.sin()
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    return cos[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """boostlr's attention on ``[b, heads, s, head_dim]``: GQA by ``repeat_interleave``,
    causal SDPA without a mask (the call boostlr's model makes), the boolean mask otherwise;
    returns ``[b, s, heads, head_dim]``."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if mask is None:
        # Same call as boostlr's model when there is no cache: bit-identical logits.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


class BoostlrAttention(nn.Module):
    """Self-attention with RoPE and GQA; ``config``, ``layer_idx`` and ``scaling`` are what
    transformers' attention interface (and vLLM, which serves each ``layer_idx`` from its own
    KV cache) reads off the module."""

    def __init__(self, config: BoostlrConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        shapes = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d)}
        for name, (d_in, d_out) in shapes.items():
            setattr(self, name, make_linear(config, d_in, d_out, layer_idx))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        z_prev: Latents | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Latents]:
        z: Latents = {}
        q, z["q_proj"] = project(self.q_proj, hidden_states, _get(z_prev, "q_proj"))
        k, z["k_proj"] = project(self.k_proj, hidden_states, _get(z_prev, "k_proj"))
        v, z["v_proj"] = project(self.v_proj, hidden_states, _get(z_prev, "v_proj"))
        b, s, _ = q.shape
        # ``-1`` heads: under a tensor-parallel plan each rank holds its share of them.
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *position_embeddings), apply_rope(k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation in OWN_ATTENTION:
            out = sdpa_attention(q, k, v, attention_mask)
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS[implementation]
            out, _ = attention_interface(
                self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
        out = out.reshape(b, s, -1)
        y, z["o_proj"] = project(self.o_proj, out, _get(z_prev, "o_proj"))
        return y, z


class BoostlrMLP(nn.Module):
    def __init__(self, config: BoostlrConfig, layer: int):
        super().__init__()
        self.form = config.mlp_form
        d, f = config.hidden_size, config.intermediate_size
        shapes = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
        for name, (d_in, d_out) in shapes.items():
            setattr(self, name, make_linear(config, d_in, d_out, layer))

    def forward(self, x: torch.Tensor, z_prev: Latents | None) -> tuple[torch.Tensor, Latents]:
        z: Latents = {}
        g, z["gate_proj"] = project(self.gate_proj, x, _get(z_prev, "gate_proj"))
        u, z["up_proj"] = project(self.up_proj, x, _get(z_prev, "up_proj"))
        product = F.silu(g) * u if self.form == "swiglu" else g * u
        y, z["down_proj"] = project(self.down_proj, product, _get(z_prev, "down_proj"))
        return y, z


class BoostlrDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: BoostlrConfig, layer: int):
        super().__init__()
        self.input_layernorm = BoostlrRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BoostlrAttention(config, layer)
        self.post_attention_layernorm = BoostlrRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_for(config, layer)

    @staticmethod
    def mlp_for(config: BoostlrConfig, layer: int) -> nn.Module:
        """Block ``layer``'s MLP: ``(y, latents) = mlp(x, z_prev)``."""
        return BoostlrMLP(config, layer)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache | None,
        z_prev: Latents | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Latents]:
        a, z_attn = self.self_attn(self.input_layernorm(x), rope, mask, cache, z_prev, **kwargs)
        x = x + a
        m, z_mlp = self.mlp(self.post_attention_layernorm(x), z_prev)
        return x + m, {**z_attn, **z_mlp}


class BoostlrPreTrainedModel(PreTrainedModel):
    config_class = BoostlrConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["BoostlrDecoderLayer"]
    _supports_sdpa = True
    # Attention goes through transformers' interface for any implementation but sdpa/eager.
    _supports_attention_backend = True
    _supports_cache_class = True  # transformers 4.x reads it before building a DynamicCache


class BoostlrModel(BoostlrPreTrainedModel):
    """Embedding, blocks and final norm (no head), like ``LlamaModel``."""

    decoder_layer: type[BoostlrDecoderLayer] = BoostlrDecoderLayer

    def __init__(self, config: BoostlrConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [self.decoder_layer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = BoostlrRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        elif not use_cache:
            cache = None
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None]
        rope = rope_tables(self.config, position_ids)
        mask = attention_bias(attention_mask, x.shape[0], x.shape[1], past, x.device)
        attention_kwargs = {k: v for k, v in kwargs.items() if k not in _MODEL_ONLY_KWARGS}
        z: Latents | None = None
        for layer in self.layers:
            x, z = layer(x, rope, mask, cache, z, **attention_kwargs)
        out = BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()


class BoostlrForCausalLM(BoostlrPreTrainedModel, GenerationMixin):
    """The model and its LM head; ``labels`` give the mean next-token cross-entropy."""

    _tied_weights_keys = (
        {"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_5 else ["lm_head.weight"]
    )
    inner_model: type[BoostlrModel] = BoostlrModel

    def __init__(self, config: BoostlrConfig):
        super().__init__(config)
        self.model = self.inner_model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        kwargs.pop("return_dict", None)  # the base model's output is read by name below
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1),
                labels[:, 1:].to(logits.device).flatten(),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)}
        )


def attention_bias(
    attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int, device: torch.device
) -> torch.Tensor | None:
    """The SDPA mask ``[b, 1, q, kv]`` (True = attend), or ``None`` for plain causal attention.

    ``None`` when nothing is padded and either there is no cache (``is_causal``) or one new
    token attends to everything. A padded query still attends to itself: some SDPA backends
    give NaN for a row with no key, and that NaN would reach later tokens through the cache.
    """
    kv_len = past + q_len
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_len:].to(device)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (past == 0 or q_len == 1):
        return None
    q_pos = torch.arange(past, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None].expand(batch, 1, q_len, kv_len)
    if padded:
        mask = mask & attention_mask.bool()[:, None, None, :]
        mask = mask | (k_pos == q_pos)[None, None]
    return mask


# Each arch's base model (``AutoModel``, what vLLM builds) and causal LM, with the arch's config.
class BoostlrSvdModel(BoostlrModel):
    config_class = BoostlrSvdConfig


class BoostlrColaModel(BoostlrModel):
    config_class = BoostlrColaConfig


class BoostlrLaxModel(BoostlrModel):
    config_class = BoostlrLaxConfig


class BoostlrSvdForCausalLM(BoostlrForCausalLM):
    config_class = BoostlrSvdConfig
    inner_model = BoostlrSvdModel


class BoostlrColaForCausalLM(BoostlrForCausalLM):
    config_class = BoostlrColaConfig
    inner_model = BoostlrColaModel


class BoostlrLaxForCausalLM(BoostlrForCausalLM):
    config_class = BoostlrLaxConfig
    inner_model = BoostlrLaxModel


MODEL_CLASSES = {
    "svd": BoostlrSvdForCausalLM,
    "cola": BoostlrColaForCausalLM,
    "lax": BoostlrLaxForCausalLM,
}
BASE_MODEL_CLASSES = {"svd": BoostlrSvdModel, "cola": BoostlrColaModel, "lax": BoostlrLaxModel}


def _get(z: Latents | None, name: str) -> torch.Tensor | None:
    return None if z is None else z.get(name)
