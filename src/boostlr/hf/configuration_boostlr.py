"""Hugging Face configuration of boostlr's low-rank LLaMA variants (SVD, CoLA, LaX).

``boostlr export`` copies this file and ``modeling_boostlr.py`` next to the weights, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` builds the real model.
It imports transformers only: an export loads without boostlr installed. Each arch has its
own ``model_type`` (``boostlr_svd``, ``boostlr_cola``, ``boostlr_lax``) so that a load
without remote code fails with transformers' "unknown model type" error instead of building
a dense LLaMA with random projections.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MLP_FORMS = ("swiglu", "lowrank-only")
LAX_GATES = ("factored", "full")


class BoostlrConfig(PretrainedConfig):
    """LLaMA-2 shape fields (HF names) plus the low-rank ones.

    ``rank`` is the bottleneck width r of every block linear (``up(σ(down(x)))``);
    ``mlp_form`` is ``swiglu`` (``silu(g) ⊙ u``) or ``lowrank-only`` (``g ⊙ u``, CoLA's
    MLP, whose nonlinearity sits inside the linears); ``lax_gate`` and ``lax_gate_rank``
    shape LaX's latent crossing between blocks.
    """

    model_type = "boostlr"
    arch = ""  # set by each arch's subclass; a class attribute, never serialised
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1376,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        rank: int = 128,
        mlp_form: str = "lowrank-only",
        lax_gate: str = "factored",
        lax_gate_rank: int | None = None,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ):
        if mlp_form not in MLP_FORMS:
            raise ValueError(f"mlp_form must be one of {MLP_FORMS}, got {mlp_form!r}")
        if lax_gate not in LAX_GATES:
            raise ValueError(f"lax_gate must be one of {LAX_GATES}, got {lax_gate!r}")
        if hidden_size % num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rank = rank
        self.mlp_form = mlp_form
        self.lax_gate = lax_gate
        self.lax_gate_rank = lax_gate_rank or max(1, rank // 4)
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class BoostlrSvdConfig(BoostlrConfig):
    """``B A x``: two factors, no nonlinearity between them."""

    model_type = "boostlr_svd"
    arch = "svd"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrColaConfig(BoostlrConfig):
    """``B σ(A x)`` with σ = SiLU (CoLA)."""

    model_type = "boostlr_cola"
    arch = "cola"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrLaxConfig(BoostlrConfig):
    """``B σ(LN_r(A x + G(z_prev)))``: CoLA plus LaX's latent crossing between blocks."""

    model_type = "boostlr_lax"
    arch = "lax"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


CONFIG_CLASSES = {"svd": BoostlrSvdConfig, "cola": BoostlrColaConfig, "lax": BoostlrLaxConfig}
