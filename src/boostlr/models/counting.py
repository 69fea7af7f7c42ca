"""Analytic parameter and FLOP counts per arch, from shapes alone.

Used for tokens/s -> FLOP/s (and MFU on GPUs) and by the cost model; tests check them against
real module parameter counts, so the formulas cannot drift from the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.config import ModelConfig
from boostlr.config.validate_moe import dispatch_of
from boostlr.models.shapes import MLP_LINEARS, linear_shapes
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_moe_layer


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token embedding (+ LM head when untied)
    matmul: int  # parameters used in a matrix multiply per token (block linears + LM head)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def linear_params(cfg: ModelConfig, d_in: int, d_out: int, layer: int) -> tuple[int, int]:
    """(all parameters, matmul parameters) of one block linear."""
    arch = arch_spec(cfg.arch)
    gate = crossing_gate_params(cfg) if arch.crossing and layer > 0 else 0
    return arch.linear_params(d_in, d_out, cfg.rank or 0, gate, layer)


def crossing_gate_params(cfg: ModelConfig) -> int:
    """Parameters of one crossing gate ``G`` (r -> r), by ``model.lax_gate``."""
    r = cfg.rank
    return r * r if cfg.lax_gate == "full" else 2 * r * cfg.lax_gate_rank


def moe_mlp_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(all parameters, matmul parameters per token) of an MoE MLP (:mod:`boostlr.models.moe`).

    A token multiplies by the router, the shared outer factors (``latent`` dispatch), its
    ``moe_top_k`` routed experts and the shared experts: the matmul count is the active one.
    """
    d, f, n_routed = cfg.dim, cfg.moe_ffn_dim or 0, cfg.moe_experts
    router = n_routed * d
    if dispatch_of(cfg).shared_outer:
        r = cfg.rank or 0
        shared_in = linear_params(cfg, d, 0, layer)  # A_g (or A_u): d -> r, LaX's crossing too
        outer = (2 * shared_in[0] + r * d, 2 * shared_in[1] + r * d)  # + B_d: r -> d
        expert = (3 * r * f, 3 * r * f)  # B_g^e, B_u^e: r -> f_e; A_d^e: f_e -> r
    else:
        outer = (0, 0)
        ps = [linear_params(cfg, d, f, layer), linear_params(cfg, d, f, layer)]
        ps.append(linear_params(cfg, f, d, layer))
        expert = (sum(p for p, _ in ps), sum(m for _, m in ps))
    total = router + outer[0] + (n_routed + cfg.moe_shared) * expert[0]
    return total, router + outer[1] + (cfg.moe_top_k + cfg.moe_shared) * expert[1]


def count_params(cfg: ModelConfig) -> ParamCount:
    """Parameters by shape; under MoE ``matmul`` counts the experts a token uses."""
    d, v = cfg.dim, cfg.vocab_size
    total = matmul = 0
    for layer in range(cfg.n_layers):
        total += 2 * d  # two RMSNorm gains
        shapes = linear_shapes(cfg)
        if is_moe_layer(cfg, layer):
            p, m = moe_mlp_params(cfg, layer)
            total, matmul = total + p, matmul + m
            shapes = {k: v for k, v in shapes.items() if k not in MLP_LINEARS}
        for d_in, d_out in shapes.values():
            p, m = linear_params(cfg, d_in, d_out, layer)
            total += p
            matmul += m
    embedding = v * d if cfg.tie_embeddings else 2 * v * d
    total += embedding + d  # + final norm
    matmul += v * d  # LM head (tied or not, it is a GEMM)
    return ParamCount(total=total, embedding=embedding, matmul=matmul)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: ``6 * matmul params + 12 * L * d * s`` (attention scores).

    The attention term uses the usual non-causal count (as in PaLM's MFU), so numbers compare
    with published MFU figures.
    """
    return 6 * count_params(cfg).matmul + 12 * cfg.n_layers * cfg.dim * seq_len
