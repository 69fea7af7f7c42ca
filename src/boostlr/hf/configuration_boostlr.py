"""Hugging Face configuration of boostlr's low-rank LLaMA variants (SVD, CoLA, LaX).

``boostlr export`` copies this file and ``modeling_boostlr.py`` next to the weights, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` builds the real model.
It imports transformers only: an export loads without boostlr installed. Each arch has its
own ``model_type`` (``boostlr_svd``, ``boostlr_cola``, ``boostlr_lax``) so that a load
without remote code fails with transformers' "unknown model type" error instead of building
a dense LLaMA with random projections. A mixture-of-experts model of any arch (``moe_*``
fields, written only for MoE models) is one of these too; a dense-linear (``full``) MoE model
is ``boostlr_full``, since an HF LLaMA has no experts.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MLP_FORMS = ("swiglu", "lowrank-only")
LAX_GATES = ("factored", "full")
MOE_DISPATCHES = ("latent", "hidden")
MOE_BALANCES = ("bias", "aux")

#: Tensor-parallel plan of a low-rank model (transformers' ``base_model_tp_plan``, which vLLM
#: reads too). A block linear ``B h(A x)`` whose output feeds heads or the MLP's ``f`` splits
#: B's output (``colwise``) with A replicated; one whose input is a head or ``f`` slice splits
#: A's input (``rowwise``, the all-reduce carries ``[T, r]``) with B replicated. Unlisted
#: modules (the other factors, norms, LaX crossings, routers, experts) are replicated.
LOWRANK_TP_PLAN = {
    "layers.*.self_attn.q_proj.up": "colwise",
    "layers.*.self_attn.k_proj.up": "colwise",
    "layers.*.self_attn.v_proj.up": "colwise",
    "layers.*.self_attn.o_proj.down": "rowwise",
    "layers.*.mlp.gate_proj.up": "colwise",
    "layers.*.mlp.up_proj.up": "colwise",
    "layers.*.mlp.down_proj.down": "rowwise",
}
#: Dense linears (arch ``full``, MoE models only): LLaMA's Megatron plan.
DENSE_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class BoostlrConfig(PretrainedConfig):
    """LLaMA-2 shape fields (HF names) plus the low-rank ones.

    ``rank`` is the bottleneck width r of every block linear (``up(σ(down(x)))``);
    ``mlp_form`` is ``swiglu`` (``silu(g) ⊙ u``) or ``lowrank-only`` (``g ⊙ u``, CoLA's
    MLP, whose nonlinearity sits inside the linears); ``lax_gate`` and ``lax_gate_rank``
    shape LaX's latent crossing between blocks.

    ``moe_experts > 0`` makes the MLP of every block from ``moe_dense_layers`` on a mixture
    of experts (boostlr's docs/moe.md): ``moe_top_k`` of ``moe_experts`` routed experts plus
    ``moe_shared`` shared ones, each of inner width ``moe_ffn_dim``; ``moe_dispatch`` is
    ``latent`` (shared outer factors, low-rank archs) or ``hidden`` (whole-MLP experts);
    ``moe_balance`` picks the router (``bias``: sigmoid scores and a selection bias,
    ``aux``: softmax); ``moe_capacity > 0`` drops routed copies past each expert's capacity,
    as boostlr's own forward does.
    """

    model_type = "boostlr"
    # Set by each arch's subclass; class attributes, never serialised. ``lowrank``: factored
    # linears; ``latent_activation``: SiLU between the factors; ``crossing``: LaX's latents.
    arch = ""
    lowrank = True
    latent_activation = False
    crossing = False
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    base_model_tp_plan = LOWRANK_TP_PLAN

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1376,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        rank: int | None = 128,
        mlp_form: str = "lowrank-only",
        lax_gate: str = "factored",
        lax_gate_rank: int | None = None,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_shared: int = 0,
        moe_ffn_dim: int | None = None,
        moe_dense_layers: int = 0,
        moe_dispatch: str = "latent",
        moe_balance: str = "bias",
        moe_capacity: float = 0.0,
        **kwargs: Any,
    ):
        if mlp_form not in MLP_FORMS:
            raise ValueError(f"mlp_form must be one of {MLP_FORMS}, got {mlp_form!r}")
        if lax_gate not in LAX_GATES:
            raise ValueError(f"lax_gate must be one of {LAX_GATES}, got {lax_gate!r}")
        if moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {moe_dispatch!r}")
        if moe_balance not in MOE_BALANCES:
            raise ValueError(f"moe_balance must be one of {MOE_BALANCES}, got {moe_balance!r}")
        if moe_experts and not 1 <= moe_top_k <= moe_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts], got {moe_top_k}")
        if moe_experts and moe_ffn_dim is None:
            raise ValueError("moe_ffn_dim is required with moe_experts > 0")
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
        self.lax_gate_rank = lax_gate_rank or (max(1, rank // 4) if rank else None)
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.moe_experts = moe_experts
        self.moe_top_k = moe_top_k
        self.moe_shared = moe_shared
        self.moe_ffn_dim = moe_ffn_dim
        self.moe_dense_layers = moe_dense_layers
        self.moe_dispatch = moe_dispatch
        self.moe_balance = moe_balance
        self.moe_capacity = moe_capacity
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
    latent_activation = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrLaxConfig(BoostlrConfig):
    """``B σ(LN_r(A x + G(z_prev)))``: CoLA plus LaX's latent crossing between blocks."""

    model_type = "boostlr_lax"
    arch = "lax"
    latent_activation = True
    crossing = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrSvdMoeConfig(BoostlrSvdConfig):
    """An svd MoE export's config. Each MoE config is a class of its own because transformers
    maps config classes to model classes for the whole process: a dense export of the same
    arch loaded earlier (from a directory of the same name) would otherwise lend the MoE
    export its dense model class."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrColaMoeConfig(BoostlrColaConfig):
    """A cola MoE export's config (a class of its own: see :class:`BoostlrSvdMoeConfig`)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrLaxMoeConfig(BoostlrLaxConfig):
    """A lax MoE export's config (a class of its own: see :class:`BoostlrSvdMoeConfig`)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)


class BoostlrFullConfig(BoostlrConfig):
    """Dense linears ``W x`` with MoE MLPs (a dense ``full`` model exports as an HF LLaMA)."""

    model_type = "boostlr_full"
    arch = "full"
    lowrank = False
    base_model_tp_plan = DENSE_TP_PLAN

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("rank", None)
        kwargs.setdefault("mlp_form", "swiglu")
        super().__init__(**kwargs)


CONFIG_CLASSES = {"svd": BoostlrSvdConfig, "cola": BoostlrColaConfig, "lax": BoostlrLaxConfig}
#: The remote-code config of a ``full`` MoE model (not in ``CONFIG_CLASSES``, the low-rank
#: archs' table: a dense ``full`` model is an HF LLaMA).
MOE_ONLY_CONFIG_CLASSES = {"full": BoostlrFullConfig}
#: Every arch's MoE config class (see :class:`BoostlrSvdMoeConfig` for why they are apart).
MOE_CONFIG_CLASSES = {
    "svd": BoostlrSvdMoeConfig,
    "cola": BoostlrColaMoeConfig,
    "lax": BoostlrLaxMoeConfig,
    **MOE_ONLY_CONFIG_CLASSES,
}
