"""The run configuration's schema: four sections of typed fields with their defaults.

Everything a run needs is one :class:`RunConfig`. Each field has a docstring saying what it
does; a field whose values are a fixed set is typed with that set (``Literal``), and the
tuples below are those sets for validation messages. docs/config.md, the config reference,
is generated from these docstrings (``python -m boostlr.config.reference > docs/config.md``),
so write them for users. Resolution and validation live in :mod:`boostlr.config.validate`,
reading TOML and ``--section.key`` overrides in :mod:`boostlr.config.parse`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from boostlr.specs import arch as _arch
from boostlr.specs.schedule import schedule_spec
from boostlr.specs.strategy import default_strategy

Arch = Literal["full", "cola", "svd", "lax"]
MlpForm = Literal["auto", "lowrank-only", "swiglu"]
LaxGate = Literal["factored", "full"]
Dtype = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
TPStrategy = Literal["auto", "megatron", "vanilla", "btp"]
NormMode = Literal["online", "sync"]
ActCkpt = Literal["none", "lowrank", "block"]
DPMode = Literal["auto", "fsdp", "ddp"]
PPSchedule = Literal["gpipe", "1f1b", "interleaved"]
MoeDispatch = Literal["auto", "latent", "hidden"]
MoeBalance = Literal["bias", "aux"]
Auto = Literal["auto"]

ARCHS: tuple[str, ...] = get_args(Arch)
LOWRANK_ARCHS = _arch.LOWRANK_ARCHS
MLP_FORMS: tuple[str, ...] = get_args(MlpForm)
LAX_GATES: tuple[str, ...] = get_args(LaxGate)
DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
TP_STRATEGIES: tuple[str, ...] = get_args(TPStrategy)
NORM_MODES: tuple[str, ...] = get_args(NormMode)
ACT_CKPT_MODES: tuple[str, ...] = get_args(ActCkpt)
DP_MODES: tuple[str, ...] = get_args(DPMode)
PP_SCHEDULES: tuple[str, ...] = get_args(PPSchedule)
MOE_DISPATCHES: tuple[str, ...] = get_args(MoeDispatch)
MOE_BALANCES: tuple[str, ...] = get_args(MoeBalance)
# Keys a run writes (config.toml, checkpoint metadata, exports) only when set away from
# their default, so a model without them saves exactly what it saved before they existed
# and its old checkpoints still resume (boostlr.config.parse.to_dict).
OMITTED_AT_DEFAULT: dict[str, tuple[str, ...]] = {
    "model": (
        "moe_experts",
        "moe_top_k",
        "moe_shared",
        "moe_ffn_dim",
        "moe_dense_layers",
        "moe_dispatch",
        "moe_balance",
        "moe_aux_coef",
        "moe_bias_rate",
        "moe_capacity",
    ),
    "parallel": ("ep", "ep_receive_factor"),
}


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
    # The BOOST paper's weak-scaling series ends at 40B; its shape is not published here:
    # LLaMA's rules at d 8192 (ffn 2/3 x 4d rounded up to 256, 128-wide heads), 48 blocks
    # (39.4B parameters with the 32k vocabulary; 48 splits over pp 2, 4, 8, 12, 16).
    "40B": Preset(8192, 22016, 48, 64, 64),
}


@dataclass
class ModelConfig:
    """Model shape and architecture. Shape fields left unset come from ``preset``."""

    preset: str = "small"
    """Shape preset: dim, ffn_dim, layers, heads and kv heads. ``tiny`` (64/176/2 layers/4
    heads) and ``small`` (128/352/4 layers/4 heads) are for tests and the CPU demo; ``60M`` to
    ``40B`` are LLaMA shapes."""
    arch: Arch = "cola"
    """``full`` (dense LLaMA), ``cola`` (``B σ(A x)``), ``svd`` (``B A x``) or ``lax``
    (``B σ(LN_r(A x + G(z_prev)))``: CoLA with a gated crossing from the previous layer's
    latent)."""
    dim: int | None = None
    """Hidden size; unset takes the preset's (set it to override the preset's shape)."""
    n_layers: int | None = None
    """Transformer blocks; unset takes the preset's."""
    n_heads: int | None = None
    """Attention heads; unset takes the preset's."""
    n_kv_heads: int | None = None
    """Key/value heads (fewer than ``n_heads`` is GQA); unset takes the preset's."""
    ffn_dim: int | None = None
    """MLP inner width; unset takes the preset's."""
    vocab_size: int = 0
    """0 takes it from the dataset's tokenizer (or the preset when planning)."""
    rank: int | None = None
    """Rank of every low-rank linear; an explicit rank wins over ``rank_ratio``. For
    ``parallel.tp_strategy vanilla`` it must be divisible by ``parallel.tp``."""
    rank_ratio: float = 0.25
    """``rank = round(rank_ratio x dim)`` when ``rank`` is unset."""
    mlp: MlpForm = "auto"
    """``lowrank-only`` (``down(gate(x) ⊙ up(x))`` of low-rank linears) or ``swiglu``;
    ``auto`` picks the first for low-rank archs, the second for ``full``."""
    lax_gate: LaxGate = "factored"
    """LaX's crossing map G: ``factored`` (r -> r/4 -> r) or ``full`` (r x r)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the embedding with the LM head (under btp the table splits as the head does;
    refused with ``parallel.pp > 1``)."""
    max_seq_len: int = 4096
    """Longest sequence the RoPE tables cover; ``data.seq_len`` may not exceed it."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    moe_experts: int = 0
    """Routed experts per mixture-of-experts MLP; 0 keeps the dense MLP in every block. Each
    token goes to ``moe_top_k`` of them, picked by a router ``d -> moe_experts`` on the
    block's normed input."""
    moe_top_k: int = 2
    """Routed experts each token uses (at most ``moe_experts``); their outputs are summed
    with the router's weights, which add up to 1."""
    moe_shared: int = 0
    """Shared experts: MLPs of width ``moe_ffn_dim`` that every token uses with weight 1,
    beside the routed ones."""
    moe_ffn_dim: int | None = None
    """Inner width of each expert (routed and shared); required with ``moe_experts > 0``."""
    moe_dense_layers: int = 0
    """The first blocks keep the dense MLP (of width ``ffn_dim``); the MoE MLP starts at this
    block index, which must be below ``n_layers``."""
    moe_dispatch: MoeDispatch = "auto"
    """What a routed token carries to its experts. ``latent`` (low-rank archs): the experts
    share the outer factors ``A_g, A_u`` (d -> r) and ``B_d`` (r -> d), so a token travels as
    ``[σ(A_g x) | σ(A_u x)]`` (2r wide) and returns as the r-wide ``w σ(A_d^e h_e)``, one
    ``B_d`` applied to the weighted sum: 3r elements per routed copy. ``hidden``: every expert
    is a whole MLP of the arch and the token travels d wide (2d per copy); ``full`` takes only
    this, ``lax`` only ``latent`` (its crossing latents belong to the shared ``A_g, A_u``; the
    experts' down latent has no crossing). ``auto``: ``latent`` for low-rank archs, ``hidden``
    for ``full``."""
    moe_balance: MoeBalance = "bias"
    """How experts are kept evenly loaded. ``bias``: DeepSeek-V3's auxiliary-loss-free balance:
    sigmoid router scores plus a per-expert bias that only steers the selection, moved by
    ``moe_bias_rate`` after each optimizer step against the step's load (kept in
    checkpoints). ``aux``: softmax router scores and a sequence-level balance loss weighted
    by ``moe_aux_coef``."""
    moe_aux_coef: float = 0.01
    """Weight of the sequence-level balance loss under ``moe_balance aux`` (ignored by
    ``bias``)."""
    moe_bias_rate: float = 0.001
    """Step of the balance bias per optimizer step under ``moe_balance bias``: each
    expert's bias moves up by it when the expert got fewer tokens than the mean, down when
    more (ignored by ``aux``)."""
    moe_capacity: float = 0.0
    """0: dropless, every routed copy is computed (sizing the experts' work costs one
    device-to-host copy of the per-expert counts per MoE layer and micro-batch). > 0: a
    capacity factor: each expert takes at most ``ceil(moe_capacity x tokens x moe_top_k /
    moe_experts)`` copies, in fixed shapes with no host sync; the copies over it are dropped
    (first choices are served before second ones, earlier tokens before later) and counted.
    A dropped copy adds nothing; the token keeps its residual and the shared experts. At
    ``parallel.ep > 1`` ``tokens`` are one rank's: each rank sends each expert at most that
    many copies in one fixed-shape all-to-all, the drops of dp at ep 1."""

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
    """A directory written by ``boostlr prepare``; unset uses the embedded stdlib corpus,
    prepared once and cached in ``$BOOSTLR_CACHE`` (default ``~/.cache/boostlr``)."""
    seq_len: int = 128
    """Tokens per training sequence (at most ``model.max_seq_len``)."""
    default_vocab: int = 4096
    """BPE vocabulary of the default corpus (used only when ``path`` is unset)."""
    val_batches: int = 8
    """Validation set: the first ``val_batches x global batch`` windows of the val split (the
    same at every layout), in ``train.batch_size`` batches shared out over the dp ranks."""


@dataclass
class TrainConfig:
    """Optimiser, schedule, precision and bookkeeping cadence."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per micro-batch on each data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per step; derived (and the given value ignored) when ``global_batch`` is
    set."""
    lr: float = 3e-3
    """Peak learning rate: linear warmup to it, then cosine to ``min_lr_ratio x lr``."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at min_lr_ratio x lr."""
    warmup: int = 30
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay (none on norm gains). AdamW is fused when available."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    grad_clip: float = 1.0
    """Clip by the L2 norm of the whole model's gradient; 0 turns clipping off."""
    seed: int = 0
    """Weights (one generator per parameter, the same at every layout) and data order."""
    dtype: Dtype = "float32"
    """``float32``, or ``bfloat16``: autocast compute and FSDP bf16 gathers, fp32 master
    weights."""
    log_every: int = 10
    """Steps between metrics rows (the only steps that read values back from the device)."""
    eval_every: int = 100
    """Steps between evaluations; the last step always evaluates."""
    ckpt_every: int = 100
    """Steps between checkpoints; the last step always saves."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept; older ones are pruned."""
    async_ckpt: bool = False
    """Write checkpoints in the background (DCP async_save on its own gloo group): the step
    loop blocks only for the copy of this rank's shards to host memory."""
    save_on_signal: str = "SIGTERM,SIGUSR1"
    """Signals (comma-separated) on which every rank finishes its step, saves a checkpoint
    there and exits with code 75, "stopped early, resume me" (to any rank, or to the
    launcher: ``boostlr``'s own, torchrun, srun); empty lets them end the run as usual."""
    time_limit: str = "auto"
    """Save and exit with code 75 while twice the measured save time (plus a step) is
    left: a duration from the process's start (``3h50m``, ``90m``, ``3600``, ``3:50:00``),
    ``auto`` (the SLURM job's end time under SLURM, else none) or ``none``."""
    compile: bool = False
    """torch.compile every block (inductor): each collective-free region is one graph, the
    collectives between them stay eager. Needs a C++ compiler on CPU, Triton on CUDA. An
    MoE model at ``parallel.ep > 1`` needs ``model.moe_capacity > 0`` (fixed shapes; dropless
    all-to-all sizes change every micro-batch)."""
    profile_steps: str = ""
    """``A:B`` writes a torch.profiler trace of steps A..B into the run directory, one file
    per rank (``trace_rank{r}_steps{A}-{B}.json``); empty is off."""
    memory_phases: bool = False
    """Write each rank's memory per phase (start-up, materialise, FSDP wrap, optimizer
    state, forward/backward, step, eval, save) to ``<run>/memory/rank<N>.json``
    (``benchmarks/memory.py`` prints it)."""
    cpu_alloc_cache: bool = True
    """CPU runs (Linux): a caching host allocator, so the large tensors every step
    reallocates skip the kernel's page faults: jemalloc/tcmalloc preloaded into the ranks
    when installed (``LD_PRELOAD`` set by the launcher), else glibc's heap told to keep what
    it frees (mallopt)."""
    fused_loss: bool = True
    """The LM head and its cross-entropy in one step: each chunk of logits becomes its
    gradient while in cache, so one ``[tokens, vocab]`` buffer is kept instead of about four
    (logits, their fp32 copy, log-softmax, gradient); same loss and gradients to fp32
    rounding. Under a pipeline the last stage's forward ends in it too."""
    global_batch: int = 0
    """Sequences per optimizer step over all data-parallel ranks; 0 = ``batch_size x
    grad_accum x dp``. When set it derives ``grad_accum = global_batch / (batch_size x dp)``,
    which must divide evenly."""
    tensorboard: bool = False
    """Copy every metrics row to TensorBoard event files in ``<run>/tb/`` (needs
    ``tensorboard``: the ``tb`` extra)."""
    wandb: str | None = None
    """Copy every metrics row to this Weights & Biases project (needs ``wandb``: the
    ``wandb`` extra; ``WANDB_MODE=offline`` works)."""


@dataclass
class ParallelConfig:
    """Process layout (pp x dp x tp) and tensor-parallel options (docs/design.md §2, §4)."""

    device: Device = "auto"
    """``cpu`` (gloo), ``cuda`` (NCCL), or auto: cuda when available."""
    nproc: int = 0
    """Local processes to launch; 0 = the product of the parallel degrees, else it must
    equal it. With ``dp = -1`` it is the world that dp fills. Under torchrun/srun the
    launcher's ``WORLD_SIZE`` must equal ``pp x dp x tp``."""
    tp: int = 1
    """Tensor-parallel degree; must divide heads, kv heads, dim and ffn_dim (and the rank
    for vanilla)."""
    dp: int = 1
    """Data-parallel degree (FSDP2 over the mesh's ``dp`` dim); -1 fills the rest of the
    world: ``parallel.nproc``, else the launcher's ``WORLD_SIZE`` / ``SLURM_NTASKS``, divided
    by ``pp x tp``."""
    ep: int = 1
    """Expert-parallel degree, carved out of ``dp`` (it must divide it, and
    ``model.moe_experts``): each group of ``ep`` consecutive dp ranks holds the routed
    experts ``E / ep`` apiece and sends each routed token to its expert's owner
    (docs/moe.md). 1 = every rank holds every expert. Step rows then add ``comm_ep_bytes``
    and ``comm_ep_time_s``."""
    ep_receive_factor: float = 2.0
    """At ``ep > 1`` with dropless dispatch (``model.moe_capacity 0``), the most routed
    copies one rank's experts take per MoE layer and micro-batch, over the balanced load:
    ``ceil(ep_receive_factor x T x moe_top_k)`` rows (``T`` tokens per rank; at tp > 1
    its TP rank's share). Every rank computes every rank's share from the exchanged counts
    and drops the same copies past it (later choices and later tokens first, counted in
    ``moe_dropped``), so a hot expert cannot make one rank run out of memory. 0 = no bound;
    otherwise at least 1. A capacity bounds the receive by itself; ignored at ep 1."""
    pp: int = 1
    """Pipeline-parallel degree (ranks); at most ``model.n_layers``, which it must divide
    (times ``pp_virtual`` under ``interleaved``)."""
    dp_mode: DPMode = "auto"
    """``fsdp``: parameters resharded after forward (ZeRO-3-like); under a pipeline also
    after every pipeline micro-batch's backward, whose gradients are reduce-scattered then:
    a gather in each micro-batch's forward and backward and a reduction, per FSDP unit.
    ``ddp``: kept gathered from forward to backward, only gradients reduce-scattered
    (ZeRO-2-like); under a pipeline kept gathered, with the stage's unreduced gradients,
    from the first micro-batch to the step's one reduction (torchtitan's choice under PP).
    ``auto``: without a pipeline ``fsdp``; under one (``pp > 1``, ``dp > 1``) the trainer
    asks the plan: ``ddp`` (a fifth to a sixth of the dp bytes, for a stage's gathered
    weights and full gradients) when the plan predicts it faster and its planned peak
    leaves 15% of the device's memory free, else ``fsdp``; it prints which and why at
    start (docs/planning.md). The run's saved config shows the mode it resolved to."""
    vocab_dp: bool | Auto = "auto"
    """Under data parallelism, split an untied embedding's and LM head's rows over dp: they
    exchange activations (token ids, partial embeddings, the head's input: ``[dp x T, d]``
    gathered per micro-batch and kept for the backward) and are never gathered. ``false``:
    FSDP units of their own, gathered whole (``V x d / tp``) around their forward and
    backward. ``auto`` splits unless ``dp x T > 1.5 x V / tp``, ``T`` being the tokens of
    one micro-batch on a rank (``train.batch_size x data.seq_len``, divided by
    ``parallel.microbatches`` under a pipeline) and ``V`` the vocabulary: past that the
    split's activations (about ``2 x dp x T x d`` per micro-batch) outweigh gathering and
    reducing the tables (about ``3 x V / tp x d``). Resolved to ``true``/``false`` once the
    vocabulary is known; the run's saved config and ``boostlr plan`` show the result."""
    pp_schedule: PPSchedule = "1f1b"
    """Pipeline schedule; ``interleaved`` (interleaved 1F1B) runs ``pp_virtual`` stages per
    rank. ``1f1b`` and ``interleaved`` need ``microbatches >= pp``, ``interleaved`` a
    multiple of ``pp``."""
    microbatches: int = 0
    """Pipeline micro-batches per ``train.batch_size`` micro-batch (must divide it); 0 = the
    number of stages (``pp``, or ``pp x pp_virtual`` under ``interleaved``)."""
    pp_virtual: int = 2
    """Stages per rank under the interleaved schedule (ignored by the other schedules)."""
    tp_strategy: TPStrategy = "auto"
    """``megatron`` (for ``full``), ``vanilla`` or ``btp`` (low-rank). ``auto``: at tp 1 the
    one-device model (low-rank archs with ``grouping`` run BTP's grouped block without
    collectives; measured no faster on a 2-core CPU, see benchmarks/RESULTS.md), else btp
    for low-rank archs and megatron for ``full``."""
    norm: NormMode = "online"
    """btp: RMSNorm statistics ride with the down-projection all-reduce (``online``) or get
    their own (``sync``)."""
    grouping: bool = True
    """btp: one fused GEMM for the down-projections and one all-reduce, batched
    up-projections."""
    tp_overlap: bool = True
    """btp: each up-projection B starts its latents' backward all-reduce before computing
    its weight gradient, so the exchange overlaps that GEMM, and the wait sits where the
    blocking all-reduce was: same bytes and results, less exposed communication (eager
    runs; off: blocking)."""
    act_ckpt: ActCkpt = "none"
    """Activation checkpointing: ``lowrank`` (btp's regions, no recompute traffic) or
    ``block`` (whole blocks)."""
    max_restarts: int = 0
    """Restart all ranks up to this many times when one dies (SIGKILL, OOM); they resume
    from the newest valid checkpoint by themselves."""
    timeout_s: float = 600.0
    """Seconds any collective may wait, on every process group (subgroups included), before
    the run fails instead of hanging."""
    pin_cores: bool = True
    """CPU: bind each local rank to its own slice of the cores (gloo's threads included) so
    ranks do not preempt the peers they wait for; skipped when there are more local ranks
    than cores or srun already binds them. Off leaves scheduling to the OS."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def dp_mode_by_plan(self) -> bool:
        """Whether ``dp_mode auto`` is the plan's to decide: under a pipeline with dp (both
        modes then differ in memory and traffic); elsewhere the layout decides it."""
        return self.pp > 1 and self.dp > 1

    @property
    def data_parallel_mode(self) -> str:
        """``dp_mode`` with ``auto`` decided by the layout alone: ``ddp`` under a pipeline,
        else ``fsdp``. A run's resolved config holds the plan's choice instead
        (:func:`boostlr.config.resolve.resolve`); this is what a config read without a
        device (a test's build) takes; ``boostlr plan`` applies the trainer's rule on the
        profile's memory (:func:`boostlr.analysis.plan.predict_as_trained`)."""
        if self.dp_mode != "auto":
            return self.dp_mode
        return "ddp" if self.pp > 1 else "fsdp"

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages held by each pp rank."""
        if self.pp == 1:
            return 1
        return schedule_spec(self.pp_schedule).stages_per_rank(self.pp_virtual)

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
        return default_strategy(_arch.arch_spec(arch)).name


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
