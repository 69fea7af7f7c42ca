"""What each tensor-parallel strategy is: what it shards, what it can run, what it sends.

The runtime modules (:mod:`boostlr.parallel.btp`, ``vanilla``, ``megatron``) implement these;
validation, the pipeline's boundary shapes, the planner and the plots read them. A strategy's
traffic is a function of the shapes here (torch-free numbers), so the cost model states it
once and the tests hold it against the communication ledger of real runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from boostlr.specs.arch import ArchSpec
from boostlr.specs.table import lookup

FP32 = 4
#: The act_ckpt modes the plain single-device model runs (no TP regions to checkpoint).
SINGLE_ACT_CKPT = ("none", "block")


@dataclass(frozen=True)
class BlockShape:
    """The numbers a strategy's traffic depends on: ``tokens`` per micro-batch, the model's
    widths, ``act`` bytes per activation element in flight (2 under bf16 autocast), and
    whether the arch's latents cross between blocks."""

    tokens: int
    dim: int
    kv_dim: int
    ffn_dim: int
    rank: int
    act: int = FP32
    crossing: bool = False


@dataclass(frozen=True)
class Traffic:
    """One rank's TP payload bytes and collective calls, forward and backward."""

    fwd: int = 0
    bwd: int = 0
    calls_fwd: int = 0
    calls_bwd: int = 0


def _megatron_block(s: BlockShape, grouping: bool, norm: str) -> Traffic:
    # o and down are row-parallel: an all-reduce of [T, d] after each; their mirror backward.
    return Traffic(2 * s.tokens * s.dim * s.act, 2 * s.tokens * s.dim * s.act, 2, 2)


def _vanilla_block(s: BlockShape, grouping: bool, norm: str) -> Traffic:
    # Every B all-reduces its full output [T, d_out]; backward: copy_to_group on each distinct
    # A input (norm(x) twice, the attention output, the MLP product). A crossing arch gathers
    # each split latent to all of r (and back) on the way.
    T, d, kv, f, a = s.tokens, s.dim, s.kv_dim, s.ffn_dim, s.act
    gather, gather_calls = (7 * T * s.rank * a, 7) if s.crossing else (0, 0)
    return Traffic(
        T * (3 * d + 2 * kv + 2 * f) * a + gather,
        T * (3 * d + f) * a + gather,
        7 + gather_calls,
        4 + gather_calls,
    )


def _btp_block(s: BlockShape, grouping: bool, norm: str) -> Traffic:
    # Seven [T, r] latents + two norms' [T, 1] statistics in fp32 precision (under bf16 a
    # hi/lo pair of bf16 columns: the same bytes); grouped down-projections share a call.
    T, r, a = s.tokens, s.rank, s.act
    calls_fwd, calls_bwd = (4, 4) if grouping else (7, 7)
    if norm == "sync":
        calls_fwd += 2  # the statistics travel on their own
    return Traffic(T * 7 * r * a + 2 * T * FP32, T * 7 * r * a, calls_fwd, calls_bwd)


def _vocab_parallel_embedding(s: BlockShape) -> Traffic:
    return Traffic(fwd=s.tokens * s.dim * FP32, calls_fwd=1)  # the fp32 residual all-reduced


def _head_input_grad(s: BlockShape) -> Traffic:
    return Traffic(bwd=s.tokens * s.dim * s.act, calls_bwd=1)  # the LM head's input grad


def _no_traffic(s: BlockShape) -> Traffic:
    return Traffic()


def _btp_tied_embedding(s: BlockShape) -> Traffic:
    # A table tied to the head is vocabulary-parallel: the fp32 partial embeddings [T, d]
    # reduce-scattered to d-slices, their gradient all-gathered back (payload: the full buffer).
    return Traffic(s.tokens * s.dim * FP32, s.tokens * s.dim * FP32, 1, 1)


def _btp_final(s: BlockShape) -> Traffic:
    # The last hidden state gathered (fp32 residual) and the final norm gain (as used); their
    # reduce-scatters backward.
    once = s.tokens * s.dim * FP32 + s.dim * s.act
    return Traffic(once, once, 2, 2)


#: Aten ops the host dispatches per kernel the plan counts (``gemms.block_kernels`` plus the
#: GEMMs), (fp32, bf16): eager PyTorch adds about one view or wrapper per kernel (a weight's
#: ``t``, a ``reshape``, an autograd ``detach``, a cast to the dtype a tensor already has),
#: and bf16 autocast adds the casts of each GEMM's operands. Counted per block by
#: ``benchmarks/dispatch_census.py`` (megatron and vanilla alike);
#: ``tests/test_host_ops.py`` holds every strategy's figure against a real step.
HOST_OPS_PER_KERNEL = (2.0, 2.3)
#: The plain model at tp 1 (one device, or FSDP over dp): plain tensors, without a TP
#: strategy's DTensor unwrapping and stage-boundary casts.
PLAIN_HOST_OPS_PER_KERNEL = (1.8, 2.1)


@dataclass(frozen=True)
class StrategySpec:
    """One strategy's facts.

    ``residual_sharded``: the residual stream between blocks is ``d/tp`` wide on each rank
    (BTP), not replicated. ``splits_rank``: the low-rank latent ``r`` is split over tp
    (vanilla), so tp must divide it. ``replicates_heads``: q/k/v are all-reduced to full
    width, so every rank runs every head and the whole MLP width (vanilla).
    ``bottleneck_regions``: a TP region runs from an up-projection to the next
    down-projection, so the all-reduce carries the ``[T, r]`` latent, norms fold into the
    down-projections and down-projections sharing an input are grouped (BTP). ``act_ckpt``:
    the activation-checkpoint modes it runs. ``ties_embeddings``: whether the embedding and
    the head can share one table under it. ``block_traffic`` / ``first_traffic`` /
    ``last_traffic``: its collectives per block, on a first stage (embedding) and on a last
    one (beside the loss statistics every strategy combines); ``tied_first_traffic``: the
    first stage's with a tied table, when it differs. ``host_ops_per_kernel``: (fp32, bf16)
    aten ops its ranks dispatch per planned kernel (:data:`HOST_OPS_PER_KERNEL`).
    ``colour`` / ``line``: how the plots draw it.
    """

    name: str
    takes_lowrank: bool
    residual_sharded: bool = False
    splits_rank: bool = False
    replicates_heads: bool = False
    bottleneck_regions: bool = False
    act_ckpt: tuple[str, ...] = SINGLE_ACT_CKPT
    ties_embeddings: bool = True
    block_traffic: Callable[[BlockShape, bool, str], Traffic] = _megatron_block
    first_traffic: Callable[[BlockShape], Traffic] = _vocab_parallel_embedding
    tied_first_traffic: Callable[[BlockShape], Traffic] | None = None
    last_traffic: Callable[[BlockShape], Traffic] = _head_input_grad
    host_ops_per_kernel: tuple[float, float] = HOST_OPS_PER_KERNEL
    colour: str = "black"
    line: str = "-"

    def embedding_traffic(self, shape: BlockShape, tied: bool) -> Traffic:
        """A first stage's embedding collectives (``tied``: the table is the head's)."""
        if tied and self.tied_first_traffic is not None:
            return self.tied_first_traffic(shape)
        return self.first_traffic(shape)

    def takes(self, arch: ArchSpec) -> bool:
        return arch.lowrank == self.takes_lowrank

    def residual_width(self, dim: int, tp: int) -> int:
        """Width of the residual stream (and the pipeline's stage boundary) on one rank."""
        return dim // tp if self.residual_sharded else dim

    def latent_width(self, rank: int, tp: int) -> int:
        """Width of one linear's latent on one rank."""
        return rank // tp if self.splits_rank else rank

    def gathers_latents(self, arch: ArchSpec) -> bool:
        """Whether a crossing arch's split latents are gathered whole for the crossing."""
        return self.splits_rank and arch.crossing


MEGATRON = StrategySpec("megatron", takes_lowrank=False, colour="#7f7f7f", line="^-")
VANILLA = StrategySpec(
    "vanilla",
    takes_lowrank=True,
    splits_rank=True,
    replicates_heads=True,
    block_traffic=_vanilla_block,
    colour="#d62728",
    line="s--",  # dashed: it meets btp
)
BTP = StrategySpec(
    "btp",
    takes_lowrank=True,
    residual_sharded=True,
    bottleneck_regions=True,
    act_ckpt=("none", "block", "lowrank"),
    block_traffic=_btp_block,
    first_traffic=_no_traffic,  # a local lookup of this rank's d-slice
    tied_first_traffic=_btp_tied_embedding,  # tied: split as the head, reduce-scattered
    last_traffic=_btp_final,
    # Online RMSNorm's fp32 statistics and the grouped GEMMs' operand and gradient casts:
    # more ops per kernel than the other strategies (kernels in bf16).
    host_ops_per_kernel=(2.4, 3.1),
    colour="#1f77b4",
    line="o-",
)

STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (MEGATRON, VANILLA, BTP)}
#: The strategy the plan's speed-up column divides by and whose scaling points it labels.
REFERENCE = BTP


def strategy_spec(name: str) -> StrategySpec:
    """The spec of strategy ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(STRATEGIES, name, "tp strategy")


def spec_or_none(name: str | None) -> StrategySpec | None:
    """:func:`strategy_spec`, with ``None`` (the plain single-device model) passed through."""
    return None if name is None else strategy_spec(name)


def host_ops_per_kernel(strategy: str | None, dtype: str) -> float:
    """Aten ops a rank dispatches per planned kernel under ``strategy`` (``None``: the plain
    model) in ``dtype`` (``"float32"`` or ``"bfloat16"``)."""
    s = spec_or_none(strategy)
    fp32, bf16 = s.host_ops_per_kernel if s is not None else PLAIN_HOST_OPS_PER_KERNEL
    return bf16 if dtype == "bfloat16" else fp32


def default_strategy(arch: ArchSpec) -> StrategySpec:
    """The strategy ``parallel.tp_strategy auto`` picks under tp > 1."""
    return BTP if arch.lowrank else MEGATRON


def strategies_for(arch: ArchSpec) -> list[StrategySpec]:
    """Every strategy that runs ``arch``, in :data:`STRATEGIES`' order."""
    return [s for s in STRATEGIES.values() if s.takes(arch)]


def act_ckpt_modes(name: str | None) -> tuple[str, ...]:
    """The act_ckpt modes strategy ``name`` runs (``None``: the single-device model)."""
    return SINGLE_ACT_CKPT if name is None else strategy_spec(name).act_ckpt
