"""Resolve a config (presets, ``dp = -1``, ``global_batch``) and check every value.

Validation happens before any work: a bad value raises
:class:`~boostlr.errors.ConfigError` with a one-line message naming the key and the fix.
"""

from __future__ import annotations

import os

from boostlr.config.schema import (
    ACT_CKPT_MODES,
    ARCHS,
    DEVICES,
    DP_MODES,
    DTYPES,
    LAX_GATES,
    MLP_FORMS,
    NORM_MODES,
    PP_SCHEDULES,
    PRESETS,
    TP_STRATEGIES,
    ModelConfig,
    ParallelConfig,
    RunConfig,
)
from boostlr.config.stopping import check_stop_config
from boostlr.config.validate_moe import validate_moe
from boostlr.errors import ConfigError
from boostlr.specs.arch import LOWRANK_ARCHS, arch_spec
from boostlr.specs.schedule import SCHEDULES, schedule_spec
from boostlr.specs.strategy import STRATEGIES, act_ckpt_modes, spec_or_none


def launcher_world_size() -> int | None:
    """WORLD_SIZE of torchrun, or srun's task count; ``None`` outside a launcher."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                raise ConfigError(
                    f"environment {key}={os.environ[key]!r} is not a number"
                ) from None
    return None


def resolve_layout(cfg: RunConfig) -> None:
    """Fill ``parallel.dp = -1`` from the world size and ``grad_accum`` from ``global_batch``,
    ``parallel.vocab_dp auto`` once the vocabulary is known, and ``parallel.dp_mode auto``
    where the layout alone decides it (no pipeline, or no dp); under a pipeline with dp it
    stays ``auto`` for :func:`boostlr.config.resolve.resolve` (the plan's choice)."""
    p, t = cfg.parallel, cfg.train
    if p.dp == -1:
        world = p.nproc or launcher_world_size()
        if not world:
            raise ConfigError(
                "parallel.dp -1 fills the world, but no world size is known: set "
                "--parallel.nproc N (or start under torchrun/srun), or give --parallel.dp"
            )
        rest = p.pp * p.tp
        if rest < 1 or world % rest:
            raise ConfigError(
                f"parallel.dp -1: the world of {world} ranks is not a multiple of pp x tp = "
                f"{rest}: change --parallel.nproc, --parallel.pp or --parallel.tp"
            )
        p.dp = world // rest
    if t.global_batch:
        per_step = t.batch_size * max(p.dp, 1)
        if t.global_batch < 0 or t.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {t.global_batch} is not a multiple of train.batch_size x "
                f"parallel.dp = {per_step}: pick a global batch divisible by it, or change "
                "--train.batch_size / --parallel.dp"
            )
        t.grad_accum = t.global_batch // per_step
    if p.dp_mode == "auto" and not p.dp_mode_by_plan:  # the layout decides (no pipeline)
        p.dp_mode = p.data_parallel_mode
    resolve_vocab_dp(cfg)


def vocab_dp_rule(cfg: RunConfig) -> bool:
    """Whether ``parallel.vocab_dp auto`` splits the vocabulary over dp (docs/design.md §4.6).

    Split unless ``dp x T > 1.5 x V / tp``, with ``T`` the tokens of one micro-batch on a
    rank (``batch_size x seq_len``, over ``parallel.microbatches`` under a pipeline: the
    head runs once per pipeline micro-batch) and ``V`` the vocabulary. Per micro-batch the
    split all-gathers the head input ``[dp x T, d]`` and reduce-scatters its gradient (the
    embedding likewise): about ``2 x dp x T x d`` elements, kept for the backward; FSDP-held
    tables gather ``V/tp x d`` in the forward and again in the backward and reduce-scatter
    their gradient: about ``3 x V/tp x d``. Equal at ``dp x T = 1.5 x V / tp``; at equality
    the split stays (no gathered tables, and the bytes are the same).
    """
    p, t = cfg.parallel, cfg.train
    micro = t.batch_size // (p.pp_microbatches if p.pp > 1 else 1)
    tokens = micro * cfg.data.seq_len
    return not p.dp * tokens > 1.5 * cfg.model.vocab_size / p.tp


def resolve_vocab_dp(cfg: RunConfig) -> None:
    """Turn ``parallel.vocab_dp = "auto"`` into the rule's bool, once the vocabulary is known.

    The one place ``auto`` is decided: :func:`resolve_layout` calls it (a config whose
    vocabulary is set), the trainer once the tokenizer gives the vocabulary
    (``boostlr.config.resolve.resolve``), the planner once it takes the preset's. Every
    consumer reads the bool (``ParallelConfig.vocab_over_dp``); the saved config shows it.
    """
    if cfg.parallel.vocab_dp == "auto" and cfg.model.vocab_size >= 1:
        cfg.parallel.vocab_dp = vocab_dp_rule(cfg)


def vocab_over_dp(cfg: RunConfig) -> bool:
    """``parallel.vocab_dp`` as a bool: as resolved, or by :func:`vocab_dp_rule` for a config
    whose vocabulary was set after its resolution (the rule's one definition either way)."""
    value = cfg.parallel.vocab_dp
    if isinstance(value, bool):
        return value
    if cfg.model.vocab_size < 1:
        raise ValueError("parallel.vocab_dp auto needs the vocabulary: set model.vocab_size")
    return vocab_dp_rule(cfg)


def resolve_model(model: ModelConfig, vocab_size: int | None = None) -> ModelConfig:
    """Fill shape fields from the preset and the rank from ``rank_ratio`` (in place)."""
    if model.preset not in PRESETS:
        raise ConfigError(
            f"model.preset '{model.preset}' is unknown: choose one of {', '.join(PRESETS)}"
        )
    preset = PRESETS[model.preset]
    for name in ("dim", "n_layers", "n_heads", "ffn_dim"):
        if getattr(model, name) is None:
            setattr(model, name, getattr(preset, name))
    if model.n_kv_heads is None:
        # Keep the preset's MHA/GQA ratio when only n_heads was overridden.
        model.n_kv_heads = model.n_heads if model.n_heads != preset.n_heads else preset.n_kv_heads
    if vocab_size is not None:
        model.vocab_size = vocab_size
    if model.rank is None and model.lowrank:
        if not 0 < model.rank_ratio <= 1:
            raise ConfigError(f"model.rank_ratio must be in (0, 1], got {model.rank_ratio}")
        model.rank = max(1, round(model.rank_ratio * model.dim))
    return model


def validate(cfg: RunConfig) -> None:
    """Reject impossible configurations before any work starts."""
    m, d, t = cfg.model, cfg.data, cfg.train
    _choice("model.arch", m.arch, ARCHS)
    _choice("model.mlp", m.mlp, MLP_FORMS)
    _choice("model.lax_gate", m.lax_gate, LAX_GATES)
    _choice("train.dtype", t.dtype, DTYPES)
    _choice("parallel.device", cfg.parallel.device, DEVICES)
    validate_model(m)
    validate_parallel(cfg.parallel, m)
    validate_moe(m, cfg.parallel, t.compile)
    for key, value in (
        ("data.seq_len", d.seq_len),
        ("data.val_batches", d.val_batches),
        ("train.steps", t.steps),
        ("train.batch_size", t.batch_size),
        ("train.grad_accum", t.grad_accum),
        ("train.log_every", t.log_every),
        ("train.eval_every", t.eval_every),
        ("train.ckpt_every", t.ckpt_every),
        ("train.keep_checkpoints", t.keep_checkpoints),
    ):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    mb = cfg.parallel.pp_microbatches if cfg.parallel.pp > 1 else 1
    if t.batch_size % mb:
        raise ConfigError(
            f"train.batch_size {t.batch_size} is not divisible by the {mb} pipeline "
            "micro-batches: make the batch a multiple of --parallel.microbatches"
        )
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len {d.seq_len} exceeds model.max_seq_len {m.max_seq_len}: "
            "lower data.seq_len or raise model.max_seq_len"
        )
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if t.warmup < 0:
        raise ConfigError(f"train.warmup must be >= 0, got {t.warmup}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.grad_clip < 0 or t.weight_decay < 0:
        raise ConfigError("train.grad_clip and train.weight_decay must be >= 0")
    if cfg.parallel.max_restarts < 0:
        raise ConfigError(f"parallel.max_restarts must be >= 0, got {cfg.parallel.max_restarts}")
    if not cfg.parallel.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be > 0 seconds, got {cfg.parallel.timeout_s}")
    profile_range(t.profile_steps)
    check_stop_config(t.save_on_signal, t.time_limit)
    if d.default_vocab < 260 or d.default_vocab > 2**32 - 1:
        raise ConfigError(f"data.default_vocab must be in [260, 2^32), got {d.default_vocab}")


def profile_range(spec: str) -> tuple[int, int] | None:
    """``train.profile_steps`` "A:B" as ``(A, B)`` (1-based, inclusive); ``None`` when off."""
    if not spec:
        return None
    first, sep, last = spec.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or a < 1 or b < a:
        raise ConfigError(
            f"train.profile_steps '{spec}' is not a step range: write A:B with 1 <= A <= B "
            "(e.g. --train.profile_steps 5:7)"
        )
    return a, b


def validate_parallel(p: ParallelConfig, m: ModelConfig) -> None:
    """Layout checks that must pass before any process or process group exists."""
    _choice("parallel.tp_strategy", p.tp_strategy, TP_STRATEGIES)
    _choice("parallel.norm", p.norm, NORM_MODES)
    _choice("parallel.act_ckpt", p.act_ckpt, ACT_CKPT_MODES)
    _choice("parallel.dp_mode", p.dp_mode, DP_MODES)
    _choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    if p.vocab_dp not in (True, False, "auto"):
        raise ConfigError(f"parallel.vocab_dp '{p.vocab_dp}' is not one of: true, false, auto")
    for key, value in (("tp", p.tp), ("dp", p.dp), ("pp", p.pp), ("pp_virtual", p.pp_virtual)):
        if value < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {value}")
    if p.nproc < 0 or p.microbatches < 0:
        raise ConfigError("parallel.nproc and parallel.microbatches must be >= 0 (0 = automatic)")
    if p.nproc not in (0, p.world_size):
        raise ConfigError(
            f"parallel.nproc {p.nproc} must equal the product of the parallel degrees "
            f"(pp {p.pp} x dp {p.dp} x tp {p.tp} = {p.world_size}): set --parallel.nproc "
            f"{p.world_size}, or change the degrees (--parallel.dp -1 fills the rest)"
        )
    validate_pipeline(p, m)
    strategy = p.strategy_for(m.arch)
    spec, arch = spec_or_none(strategy), arch_spec(m.arch)
    if spec is not None and spec.takes_lowrank and not arch.lowrank:
        raise ConfigError(
            f"parallel.tp_strategy {strategy} needs a low-rank arch "
            f"({', '.join(LOWRANK_ARCHS)}), not '{m.arch}': use megatron for arch full"
        )
    if spec is not None and not spec.takes(arch):
        raise ConfigError(
            f"parallel.tp_strategy {strategy} is for arch full, not '{m.arch}': use btp or vanilla"
        )
    if p.act_ckpt not in act_ckpt_modes(strategy):
        takers = " or ".join(s.name for s in STRATEGIES.values() if p.act_ckpt in s.act_ckpt)
        raise ConfigError(
            f"parallel.act_ckpt {p.act_ckpt} checkpoints BTP regions: it needs "
            f"parallel.tp_strategy {takers} (use block for other strategies)"
        )
    if spec is not None and not spec.ties_embeddings and m.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings is not supported with {strategy} (the embedding is split "
            "along d, the head along the vocabulary): set model.tie_embeddings false"
        )
    dims = {"model.dim": m.dim, "model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads}
    dims["model.ffn_dim"] = m.ffn_dim
    splits_rank = spec is not None and spec.splits_rank
    if splits_rank:
        dims["model.rank"] = m.rank
    for key, value in dims.items():
        if value % p.tp:
            raise ConfigError(
                f"parallel.tp {p.tp} does not divide {key} {value}: pick a tp that divides "
                "heads, kv heads, dim and ffn_dim" + (" and rank" if splits_rank else "")
            )


def validate_pipeline(p: ParallelConfig, m: ModelConfig) -> None:
    """Stage split and schedule checks (docs/design.md §4: torch aborts on some of these)."""
    if p.pp == 1:
        return
    if p.pp > m.n_layers:
        raise ConfigError(
            f"parallel.pp {p.pp} exceeds model.n_layers {m.n_layers}: every stage needs a "
            "layer, lower --parallel.pp"
        )
    if m.n_layers % p.num_stages:
        what = f"pp x pp_virtual = {p.num_stages}" if p.virtual_stages > 1 else f"pp {p.pp}"
        raise ConfigError(
            f"model.n_layers {m.n_layers} is not divisible by {what} pipeline stages: pick a "
            "pp (and pp_virtual) that divides the layers evenly"
        )
    mb, schedule = p.pp_microbatches, schedule_spec(p.pp_schedule)
    if schedule.microbatches_at_least_pp and mb < p.pp:
        takers = " or ".join(s.name for s in SCHEDULES.values() if not s.microbatches_at_least_pp)
        raise ConfigError(
            f"parallel.pp_schedule {p.pp_schedule} needs at least as many micro-batches as "
            f"pipeline ranks ({p.pp}), got parallel.microbatches {mb}: raise "
            f"--parallel.microbatches or use --parallel.pp_schedule {takers}"
        )
    if schedule.microbatches_multiple_of_pp and mb % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule {p.pp_schedule} needs parallel.microbatches ({mb}) to be a "
            f"multiple of parallel.pp ({p.pp})"
        )
    if m.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings cannot be kept in sync across pipeline stages (the embedding "
            "is on the first, the head on the last): set model.tie_embeddings false or pp 1"
        )


def validate_model(m: ModelConfig) -> None:
    """Shape checks shared by training, planning and checkpoint loading."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {getattr(m, name)}")
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.n_heads {m.n_heads} does not divide model.dim {m.dim}: "
            "pick heads so that dim % n_heads == 0"
        )
    if m.head_dim % 2:
        raise ConfigError(f"head dim {m.head_dim} (dim / n_heads) must be even for RoPE")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads {m.n_kv_heads} does not divide model.n_heads {m.n_heads}: "
            "GQA needs n_heads % n_kv_heads == 0"
        )
    if m.vocab_size < 0:
        raise ConfigError(f"model.vocab_size must be >= 0, got {m.vocab_size}")
    if m.lowrank:
        if m.rank is None or m.rank < 1:
            raise ConfigError(f"model.rank must be >= 1, got {m.rank}")
        limit = min(m.dim, m.kv_dim, m.ffn_dim)
        if m.rank > limit:
            raise ConfigError(
                f"model.rank {m.rank} exceeds min(d_in, d_out) = {limit} of the smallest "
                f"linear: lower model.rank or model.rank_ratio"
            )
    if m.mlp == "lowrank-only" and not m.lowrank:
        raise ConfigError(
            "model.mlp 'lowrank-only' has no nonlinearity with full-rank linears: "
            "use model.mlp swiglu (or auto) for arch full"
        )
    validate_moe(m)


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key} '{value}' is not one of: {', '.join(options)}")


# ---------------------------------------------------------------------------- saving
