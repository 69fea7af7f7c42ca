"""The run configuration's schema: four sections of typed fields with their defaults.

Everything a run needs is one :class:`RunConfig`. Each field's comment says what it does;
the README's config reference lists them all. Resolution and validation live in
:mod:`boostlr.config.validate`, reading TOML and ``--section.key`` overrides in
:mod:`boostlr.config.parse`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
