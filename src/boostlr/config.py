"""Run configuration: dataclasses, TOML files, dotted CLI overrides and validation.

Everything a run needs is one :class:`RunConfig` with four sections. Values come from the
dataclass defaults, then an optional TOML file, then ``--section.key value`` overrides. The
fully resolved result is written to the run directory as ``config.toml`` so a run can be
reproduced or resumed from it alone. Validation happens before any work: a bad value raises
:class:`~boostlr.errors.ConfigError` with a one-line message naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from boostlr.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ARCHS = ("full", "cola", "svd", "lax")
LOWRANK_ARCHS = ("cola", "svd", "lax")
MLP_FORMS = ("auto", "lowrank-only", "swiglu")
LAX_GATES = ("factored", "full")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
TP_STRATEGIES = ("auto", "megatron", "vanilla", "btp")
NORM_MODES = ("online", "sync")
ACT_CKPT_MODES = ("none", "lowrank", "block")
DP_MODES = ("fsdp", "ddp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Preset:
    """LLaMA-shaped model sizes; ``vocab_size`` is only a planning default."""

    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 32000


PRESETS: dict[str, Preset] = {
    # Tiny shapes for tests: every dimension divisible by TP 4.
    "tiny": Preset(64, 176, 2, 4, 4, 4096),
    # The CPU demo: learns visibly in a few minutes on two cores.
    "small": Preset(128, 352, 4, 4, 4, 4096),
    "60M": Preset(512, 1376, 8, 8, 8),
    "130M": Preset(768, 2048, 12, 12, 12),
    "350M": Preset(1024, 2736, 24, 16, 16),
    "1B": Preset(2048, 5472, 24, 32, 32),
    "3B": Preset(2560, 6848, 32, 32, 32),
    "7B": Preset(4096, 11008, 32, 32, 32),
    "13B": Preset(5120, 13824, 40, 40, 40),
    "30B": Preset(6656, 17920, 60, 52, 52),
}


@dataclass
class ModelConfig:
    """Model shape and architecture. Shape fields left unset come from ``preset``."""

    preset: str = "small"
    arch: str = "cola"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    # 0 means "take it from the dataset's tokenizer" (or the preset when planning).
    vocab_size: int = 0
    # An explicit rank wins over rank_ratio (rank = round(ratio * dim)).
    rank: int | None = None
    rank_ratio: float = 0.25
    mlp: str = "auto"
    lax_gate: str = "factored"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    init_std: float = 0.02

    @property
    def lowrank(self) -> bool:
        return self.arch in LOWRANK_ARCHS

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_form(self) -> str:
        if self.mlp != "auto":
            return self.mlp
        return "lowrank-only" if self.lowrank else "swiglu"

    @property
    def lax_gate_rank(self) -> int:
        return max(1, self.rank // 4)


@dataclass
class DataConfig:
    """Where tokens come from. ``path=None`` uses the embedded stdlib corpus."""

    path: str | None = None
    seq_len: int = 128
    # Used only when ``path`` is unset: the BPE vocabulary of the default corpus.
    default_vocab: int = 4096
    val_batches: int = 8


@dataclass
class TrainConfig:
    """Optimiser, schedule, precision and bookkeeping cadence."""

    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 100
    keep_checkpoints: int = 3
    # Write checkpoints in the background (DCP async_save on its own gloo group): the step
    # loop blocks only for the copy of this rank's shards to host memory.
    async_ckpt: bool = False
    # torch.compile every block (inductor): each collective-free region is one graph, the
    # collectives between them stay eager. Needs a C++ compiler on CPU, Triton on CUDA.
    compile: bool = False
    # "A:B" writes a torch.profiler trace (Chrome/Perfetto JSON) of steps A..B into the run
    # directory, one file per rank; "" = off.
    profile_steps: str = ""
    # Write each rank's memory per phase (start-up, materialise, FSDP wrap, optimizer state,
    # forward/backward, step, eval, save) to <run>/memory/rank<N>.json.
    memory_phases: bool = False
    # CPU: a caching host allocator, so the large tensors every step reallocates skip the
    # kernel's page faults: jemalloc/tcmalloc preloaded into the ranks when installed, else
    # glibc's heap told to keep what it frees (mallopt).
    cpu_alloc_cache: bool = True
    # The LM head and its cross-entropy in one step: each chunk of logits becomes its
    # gradient while in cache; one [tokens, vocab] buffer kept instead of about four
    # (pipeline runs keep the unfused loss: their schedule owns it).
    fused_loss: bool = True
    # Sequences per optimizer step over all data-parallel ranks; 0 = batch_size x grad_accum
    # x dp. When set it derives grad_accum (it must divide evenly).
    global_batch: int = 0
    # Copy every metrics row to TensorBoard event files in <run>/tb/ (needs tensorboard).
    tensorboard: bool = False
    # Copy every metrics row to this Weights & Biases project (needs wandb; WANDB_MODE works).
    wandb: str | None = None


@dataclass
class ParallelConfig:
    """Process layout (pp x dp x tp) and tensor-parallel options (docs/design.md §2, §4)."""

    device: str = "auto"
    # Local processes to launch; 0 = the product of the parallel degrees. When set it must
    # equal that product. Under torchrun/srun the launcher's WORLD_SIZE must match it.
    nproc: int = 0
    tp: int = 1
    # Data-parallel degree; -1 fills the rest of the world (parallel.nproc or WORLD_SIZE).
    dp: int = 1
    pp: int = 1
    # fsdp: parameters resharded after forward (ZeRO-3-like); ddp: kept whole, grads reduced.
    dp_mode: str = "fsdp"
    pp_schedule: str = "1f1b"
    # Pipeline micro-batches per batch_size micro-batch; 0 = the number of pipeline stages.
    microbatches: int = 0
    # Stages per rank under the interleaved schedule.
    pp_virtual: int = 2
    # auto: none at tp 1, btp for low-rank archs, megatron for full.
    tp_strategy: str = "auto"
    norm: str = "online"
    grouping: bool = True
    # btp: each up-projection B starts its latents' backward all-reduce before computing its
    # weight gradient, so the exchange overlaps that GEMM (eager runs; off: blocking).
    tp_overlap: bool = True
    act_ckpt: str = "none"
    # Restart all ranks up to this many times when one dies (SIGKILL, OOM); they resume
    # from the newest valid checkpoint by themselves.
    max_restarts: int = 0
    # Seconds a collective may wait on any process group (subgroups included) before the
    # run fails instead of hanging.
    timeout_s: float = 600.0
    # CPU: bind each local rank to its own slice of the cores (gloo's threads included) so
    # ranks do not preempt the peers they wait for; off leaves scheduling to the OS.
    pin_cores: bool = True

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages held by each pp rank."""
        return self.pp_virtual if self.pp_schedule == "interleaved" and self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def pp_microbatches(self) -> int:
        return self.microbatches or self.num_stages

    def strategy_for(self, arch: str) -> str | None:
        """The strategy that will run (``None``: the plain single-device model)."""
        if self.tp_strategy != "auto":
            return self.tp_strategy
        if self.tp == 1:
            return None
        return "megatron" if arch == "full" else "btp"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


# ---------------------------------------------------------------------------- building


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations (cached: ``get_type_hints`` dominates a plan's layout search)."""
    return typing.get_type_hints(cls)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        if value is None:
            return None
        return _coerce(value, options[0], key)
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if annotation is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{key}: expected {name}, got {value!r}") from None
    raise ConfigError(f"{key}: unsupported field type {annotation}")  # pragma: no cover


# Keys that existed once: a config that sets one gets an error naming the removal; a run's
# own saved config (resume, checkpoints) drops it, so old runs continue.
REMOVED_KEYS = {
    "parallel.pair_exchange": (
        "was removed: tensor-parallel collectives use the backend's own (gloo/NCCL); delete the key"
    ),
}


def set_value(cfg: RunConfig, dotted: str, value: Any, saved: bool = False) -> None:
    if dotted in REMOVED_KEYS:
        if saved:
            return
        raise ConfigError(f"config key '{dotted}' {REMOVED_KEYS[dotted]}")
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name:
        raise ConfigError(
            f"unknown config key '{dotted}': keys look like section.name with section in "
            f"{', '.join(SECTIONS)}"
        )
    target = getattr(cfg, section)
    types_ = _field_types(type(target))
    if name not in types_:
        known = ", ".join(sorted(types_))
        raise ConfigError(f"unknown config key '{dotted}' (known {section} keys: {known})")
    setattr(target, name, _coerce(value, types_[name], dotted))


def apply_mapping(cfg: RunConfig, data: dict[str, Any], source: str, saved: bool = False) -> None:
    """Apply a nested ``{section: {key: value}}`` mapping (a parsed TOML file).

    ``saved``: the mapping is a run's own config, written by an earlier release.
    """
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: top-level key '{section}' must be a [section] table")
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value, saved)


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass an existing .toml file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--model.arch', 'cola', '--train.steps=5']`` into key/value pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument '{arg}': overrides look like --section.key VALUE"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value: write {arg} VALUE")
            value = args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def build_config(
    file: str | Path | None = None,
    overrides: list[tuple[str, str]] | None = None,
    saved: bool = False,
) -> RunConfig:
    """Defaults, then the TOML file, then overrides; resolved and validated.

    ``saved``: the file is a run's own ``config.toml`` (``--resume``).
    """
    cfg = RunConfig()
    if file is not None:
        apply_mapping(cfg, load_toml(file), str(file), saved)
    for key, value in overrides or []:
        set_value(cfg, key, value)
    resolve_model(cfg.model)
    resolve_layout(cfg)
    validate(cfg)
    return cfg


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
    """Fill ``parallel.dp = -1`` from the world size and ``grad_accum`` from ``global_batch``."""
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
    if strategy in ("btp", "vanilla") and not m.lowrank:
        raise ConfigError(
            f"parallel.tp_strategy {strategy} needs a low-rank arch (cola, svd, lax), not "
            f"'{m.arch}': use megatron for arch full"
        )
    if strategy == "megatron" and m.lowrank:
        raise ConfigError(
            f"parallel.tp_strategy megatron is for arch full, not '{m.arch}': use btp or vanilla"
        )
    if p.act_ckpt == "lowrank" and strategy != "btp":
        raise ConfigError(
            "parallel.act_ckpt lowrank checkpoints BTP regions: it needs parallel.tp_strategy "
            "btp (use block for other strategies)"
        )
    if strategy == "btp" and m.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings is not supported with btp (the embedding is split along d, "
            "the head along the vocabulary): set model.tie_embeddings false"
        )
    dims = {"model.dim": m.dim, "model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads}
    dims["model.ffn_dim"] = m.ffn_dim
    if strategy == "vanilla":
        dims["model.rank"] = m.rank
    for key, value in dims.items():
        if value % p.tp:
            raise ConfigError(
                f"parallel.tp {p.tp} does not divide {key} {value}: pick a tp that divides "
                "heads, kv heads, dim and ffn_dim" + (" and rank" if strategy == "vanilla" else "")
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
    mb = p.pp_microbatches
    if p.pp_schedule in ("1f1b", "interleaved") and mb < p.pp:
        raise ConfigError(
            f"parallel.pp_schedule {p.pp_schedule} needs at least as many micro-batches as "
            f"pipeline ranks ({p.pp}), got parallel.microbatches {mb}: raise "
            "--parallel.microbatches or use --parallel.pp_schedule gpipe"
        )
    if p.pp_schedule == "interleaved" and mb % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule interleaved needs parallel.microbatches ({mb}) to be a "
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


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key} '{value}' is not one of: {', '.join(options)}")


# ---------------------------------------------------------------------------- saving


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict; ``None`` values are dropped because TOML cannot hold them."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        values = dataclasses.asdict(getattr(cfg, section))
        out[section] = {k: v for k, v in values.items() if v is not None}
    return out


def dump_toml(cfg: RunConfig) -> str:
    return tomli_w.dumps(to_dict(cfg))


def from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    apply_mapping(cfg, data, "saved config", saved=True)
    return cfg


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    model = ModelConfig()
    types_ = _field_types(ModelConfig)
    for key, value in data.items():
        if key not in types_:
            raise ConfigError(f"saved model config has unknown key '{key}'")
        setattr(model, key, _coerce(value, types_[key], f"model.{key}"))
    resolve_model(model)
    validate_model(model)
    return model
