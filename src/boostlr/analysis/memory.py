"""Parameters each rank holds and the memory a training step needs on it (docs/design.md §4, §6).

Parameter shapes come from the model itself, built on the meta device (no storage, so a 30B
model costs nothing); each parameter's split dim is the strategies' own sharding rule
(:func:`boostlr.models.placement.shard_dim`), and the tests check the resulting shard sizes
against what the trainer materialises. Nothing here imports the parallel engine.
Activation memory is an estimate of the tensors autograd saves per block under each
``act_ckpt`` mode, times the pipeline micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from boostlr.analysis.comm import vocab_dp
from boostlr.config import ModelConfig, ParallelConfig
from boostlr.models.placement import VOCAB_PARAMS, chunk_range, shard_dim, stage_ids, stage_layers
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import is_routed_expert
from boostlr.specs.schedule import schedule_spec
from boostlr.specs.strategy import spec_or_none

FP32 = 4
BF16_CACHE = 2  # bytes of a weight's bf16 copy, cast by `local()` for its GEMMs


@lru_cache(maxsize=32)
def _param_shapes(key: tuple) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from boostlr.models.llama import LlamaModel  # torch import only when planning

    cfg = ModelConfig(**dict(key))
    model = LlamaModel(cfg, device="meta")
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def param_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every parameter's global name and shape (tied weights once), from a meta model."""
    return _param_shapes(tuple(sorted(dataclasses.asdict(cfg).items())))


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


@dataclass(frozen=True)
class RankParams:
    """One pipeline rank's parameters (tp rank 0, the largest chunks)."""

    local: int  # elements after tensor-parallel sharding
    modules: tuple[int, ...]  # FSDP modules' padded local shard elements (blocks, then roots)
    largest_module: int  # elements of the largest module before dp sharding
    largest_block: int = 0  # ... of the largest block; roots: the stage roots' (final norm;
    roots: int = 0  # embedding and head too when tied)
    # An untied embedding and head under data parallelism: rows split over dp (no FSDP
    # module); ``vocab`` elements held, ``vocab_local`` before the dp split.
    vocab: int = 0
    vocab_local: int = 0
    # The LM head's elements when autograd accumulates its gradient itself (FSDP's units do
    # it in their own buffers): its dp-split rows, or the head without dp. The head's
    # backward comes first, so from the second micro-batch on its new gradient sits beside
    # the held one and the micro-batch's activations.
    head_own_grad: int = 0
    # Routed experts at ``parallel.ep > 1``: what this rank holds of its ``E/ep`` experts
    # (in ``local`` too, whole, in no dp module): over ``dp_rep > 1`` its padded FSDP shard
    # (1/dp of all experts), at dp_rep 1 all ``E/ep`` of them.
    experts: int = 0
    # ... the FSDP units over dp_rep (one per MoE layer: padded local shard elements); empty
    # at dp_rep 1, where nothing gathers them.
    expert_units: tuple[int, ...] = ()
    # ... the largest of those units gathered: one MoE layer's ``E/ep`` experts.
    largest_expert_unit: int = 0

    @property
    def sharded(self) -> int:
        """Elements held with data parallelism: FSDP's shards, the dp-split vocabulary and
        the expert shards."""
        return sum(self.modules) + self.vocab + self.experts


def stage_modules(p: ParallelConfig, n_layers: int, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(layers, first, last) of each stage a pp rank holds (interleaved: rank + k*pp)."""
    out = []
    for sid in stage_ids(p, pp_rank):
        layers = stage_layers(n_layers, p.num_stages, sid)
        out.append((layers, sid == 0, sid == p.num_stages - 1))
    return out


_RANK_CACHE: dict[tuple, RankParams] = {}


def rank_params(
    cfg: ModelConfig, strategy: str | None, p: ParallelConfig, pp_rank: int, tp_rank: int = 0
) -> RankParams:
    """Elements of this rank's shards: TP chunk per the strategy, FSDP modules padded to dp."""
    key = (
        tuple(vars(cfg).values()),  # every field a scalar; asdict() would dominate a search
        strategy,
        (p.tp, p.dp, p.pp, p.num_stages, p.vocab_dp, p.ep),
        pp_rank,
        tp_rank,
    )
    if key not in _RANK_CACHE:
        if len(_RANK_CACHE) > 4096:
            _RANK_CACHE.clear()
        _RANK_CACHE[key] = _rank_params(cfg, strategy, p, pp_rank, tp_rank)
    return _RANK_CACHE[key]


def _rank_params(
    cfg: ModelConfig, strategy: str | None, p: ParallelConfig, pp_rank: int, tp_rank: int
) -> RankParams:
    tp, dp = p.tp, p.dp
    local = vocab = vocab_local = 0
    modules: list[int] = []
    largest = largest_block = roots = own_grad = experts = 0
    expert_units: list[int] = []
    largest_experts = 0
    rep = p.dp // p.ep if p.ep > 1 else 1  # ranks holding the same ep shard (dp_rep)
    split_vocab = vocab_dp(cfg, p) > 1
    shapes = param_shapes(cfg)
    for layers, first, last in stage_modules(p, cfg.n_layers, pp_rank):
        blocks, block_local = {i: 0 for i in layers}, {i: 0 for i in layers}
        root = root_local = 0
        units: list[int] = []  # an untied embedding and head are FSDP units of their own
        units_of: dict[int, int] = {}  # MoE layer -> its experts' unit over dp_rep
        gathered_of: dict[int, int] = {}  # ... and that unit gathered
        for name, shape in shapes:
            layer = _layer_of(name)
            if layer is None:
                top = name.split(".")[0]
                if top == "embed_tokens" and not first:
                    continue
                if top in ("norm", "lm_head") and not last:
                    continue
            elif layer not in blocks:
                continue
            if p.ep > 1 and is_routed_expert(name):  # E/ep rows, sharded over dp_rep
                assert layer is not None  # routed experts live in blocks
                rows, rest = shape[0] // p.ep, math.prod(shape[1:])
                local += rows * rest
                if rep == 1:  # held whole, as the blocks' dp modules leave them
                    experts += rows * rest
                    continue
                shard = -(-rows // rep) * rest  # FSDP pads dim 0 to a multiple of dp_rep
                units_of[layer] = units_of.get(layer, 0) + shard
                gathered_of[layer] = gathered_of.get(layer, 0) + rows * rest
                experts += shard
                continue
            dims = list(shape)
            dim = shard_dim(name, strategy, cfg.tie_embeddings)
            if dim is not None:
                start, end = chunk_range(dims[dim], tp_rank, tp)
                dims[dim] = end - start
            n = math.prod(dims)
            padded = -(-dims[0] // dp) * math.prod(dims[1:])
            local += n
            if dp == 1 and name == "lm_head.weight":
                own_grad = n
            if split_vocab and name in VOCAB_PARAMS:  # rows over dp first, then over tp (dim 0)
                rows = chunk_range(shape[0], 0, dp)[1]  # dp rank 0's: the largest
                if dim == 0:
                    lo, hi = chunk_range(rows, tp_rank, tp)
                    rows = hi - lo
                vocab, vocab_local = vocab + rows * math.prod(dims[1:]), vocab_local + n
                if name == "lm_head.weight":
                    own_grad = rows * math.prod(dims[1:])
            elif layer is None and name in VOCAB_PARAMS and not cfg.tie_embeddings:
                units, largest = [*units, padded], max(largest, n)
            elif layer is None:
                root, root_local = root + padded, root_local + n
            else:
                blocks[layer], block_local[layer] = blocks[layer] + padded, block_local[layer] + n
        modules += [*blocks.values(), *units, root]
        expert_units += units_of.values()
        largest_experts = max([largest_experts, *gathered_of.values()])
        largest_block = max([largest_block, *block_local.values()])
        largest, roots = max(largest, root_local, largest_block), roots + root_local
    return RankParams(
        local,
        tuple(modules),
        largest,
        largest_block,
        roots,
        vocab,
        vocab_local,
        own_grad,
        experts,
        tuple(expert_units),
        largest_experts,
    )


def activation_bytes_per_block(
    cfg: ModelConfig, strategy: str | None, tp: int, tokens: int, act: int, act_ckpt: str
) -> float:
    """Bytes autograd keeps per block for one micro-batch until its backward (estimate).

    Counted from what the block's operators save (checked against the traced trainer per
    block, ``benchmarks/RESULTS.md``): the fp32 residual, each norm's saved tensors, q and k
    after RoPE with v and the attention output, the MLP's products, and the latents.
    """
    T, t = tokens, tp if strategy else 1
    d, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    r = cfg.rank or 0
    s = spec_or_none(strategy)
    folded = s is not None and s.bottleneck_regions  # BTP: norms folded into the A's
    res = s.residual_width(d, t) if s else d  # residual width on this rank
    # latents handed to the next block
    lax_lat = 7 * T * r * act if arch_spec(cfg.arch).crossing else 0
    # BTP's folded norms (at TP > 1) hand the qkv and gate/up latents (5 of the 7) over in
    # fp32, normalised after the all-reduce, and σ keeps them so (btp._Normalise).
    normed = 5 * r if folded and t > 1 else 0
    # σ's inputs of the replicated latents (BTP), and the region inputs (σ's outputs).
    btp_latents = T * (normed * FP32 + (7 * r - normed) * act) + T * 7 * r * act
    if act_ckpt == "block":
        return T * res * FP32 + lax_lat
    if act_ckpt == "lowrank":  # region inputs: the replicated latents and the residual slice
        # (BTP's folded norms keep only their outputs, which σ keeps anyway, not the
        # all-reduced sums they divide: boostlr.parallel.btp._Normalise.)
        return btp_latents + 2 * T * res * FP32 + lax_lat
    w = 1 if s is not None and s.replicates_heads else t  # vanilla replicates q/k/v, attention
    heads_w, kv_w, ff = d // w, kv // w, f // w
    if folded:  # folded norm: its fp32 input, the normalised and the gained slice
        total = 2 * (T * res * FP32 + 2 * T * res * act)
    else:  # rms_norm: its fp32 input, x·rsqrt (fp32, for the gain), the output's GEMM cast
        total = 2 * (2 * T * res * FP32 + T * res * act)
    total += T * (2 * heads_w + 2 * kv_w) * act  # q and k after RoPE, v, attention's output
    total += 4 * T * cfg.head_dim * act  # RoPE's cos/sin, cast for q and for k
    total += T * (cfg.n_heads // w) * FP32  # logsumexp
    # swiglu: gate, up, silu(gate), product; lowrank-only: gate, up, product.
    total += (4 if cfg.mlp_form == "swiglu" else 3) * T * ff * act
    if cfg.lowrank:
        if folded:
            total += btp_latents
        else:  # A's outputs and σ's outputs (vanilla: this rank's r/t columns)
            lat = s.latent_width(r, t) if s else r
            total += 7 * 2 * T * lat * act
        total += lax_lat
    return float(total)


def grads_held_at_activation_peak(p: ParallelConfig, pp_rank: int, grad_accum: int) -> bool:
    """Whether a rank already holds the step's gradients when its activations peak.

    They do when a forward runs after a backward of the same step: gradient accumulation,
    or a 1F1B pipeline rank that runs more micro-batches than it holds (its steady state);
    interleaved schedules are counted so too. Otherwise (one micro-batch, GPipe, a 1F1B
    rank still in warm-up) the activations peak before the first backward makes gradients.
    Each schedule's answer is its spec's ``grads_before_peak``.
    """
    if grad_accum > 1:
        return True
    if p.pp == 1:
        return False
    return schedule_spec(p.pp_schedule).grads_before_peak(p.pp_microbatches, p.pp, pp_rank)


def in_flight(p: ParallelConfig, pp_rank: int) -> float:
    """Pipeline micro-batches whose activations one rank holds at once (per stage it runs).

    GPipe runs every forward first; 1F1B holds ``pp - rank``; interleaved 1F1B's first rank
    holds ``pp`` micro-batches of each of its stages plus ``pp - 1`` of warm-up (Megatron's
    count), spread over ``pp_virtual`` stages: each schedule's spec states its count.
    """
    if p.pp == 1:
        return 1.0
    spec = schedule_spec(p.pp_schedule)
    return spec.in_flight(p.pp_microbatches, p.pp, pp_rank, p.virtual_stages)
