"""Analytic parameter and FLOP counts per arch, from shapes alone.

Used for tokens/s -> FLOP/s (and MFU on GPUs) and by the cost model; tests check them against
real module parameter counts, so the formulas cannot drift from the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.config import ModelConfig
from boostlr.models.shapes import linear_shapes
from boostlr.specs.arch import arch_spec


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


def count_params(cfg: ModelConfig) -> ParamCount:
    d, v = cfg.dim, cfg.vocab_size
    total = matmul = 0
    for layer in range(cfg.n_layers):
        total += 2 * d  # two RMSNorm gains
        for d_in, d_out in linear_shapes(cfg).values():
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
