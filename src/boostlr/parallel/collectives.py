"""Autograd-aware tensor-parallel collectives, in the shape of Megatron's mappings.

Every tensor-parallel collective in boostlr goes through this module (docs/design.md §3), and
so does expert parallelism's variable all-to-all (the counts first, :func:`gather_counts`,
then :func:`all_to_all_single`; docs/moe.md):

* each primitive is a conjugate pair: whatever the forward does to the activation, the
  backward does the adjoint to its gradient (all-reduce <-> identity, all-gather <->
  take-slice / reduce-scatter);
* a group of size 1 costs nothing and records nothing, so the single-device model and the
  TP model run the same code;
* every call lands in the group's :class:`~boostlr.parallel.ledger.CommLedger` with its
  payload, so per-step totals can be logged and checked against the cost model.

Layout: helpers (record, time, split), autograd Functions, public wrappers. Process groups
are always passed explicitly through a :class:`GroupComm`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from boostlr.parallel.ledger import OPS, PHASES, CommLedger, CommRecord, OpName, Phase

__all__ = [
    "OPS",
    "PHASES",
    "CommLedger",
    "CommRecord",
    "GroupComm",
    "OpName",
    "Phase",
    "PendingAllReduce",
    "all_reduce_",
    "all_to_all_single",
    "gather_counts",
    "copy_to_group",
    "copy_to_group_pending",
    "gather_from_group",
    "reduce_from_group",
    "reduce_scatter_to_group",
    "scatter_to_group",
]

GradMode = Literal["split", "reduce_scatter"]

# Recent torch renamed the flat-tensor collectives to *_single and deprecated the old names;
# older torch (>= 2.6) only has the old ones. Same (output, input, ...) signature.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class GroupComm:
    """A process group plus the name and ledger its collectives are recorded under.

    ``group=None`` means "no parallelism here" (size 1), never "the default group":
    groups are always explicit so DP/PP/TP traffic cannot be mixed up.
    """

    group: dist.ProcessGroup | None
    name: str
    ledger: CommLedger
    # Read once: a plain attribute is what torch.compile can trace (and guard on) in the
    # ``size == 1`` shortcuts below, where a process-group query would break the graph.
    _size: int = field(init=False, repr=False, compare=False)
    _rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alone = self.group is None or not dist.is_available() or not dist.is_initialized()
        object.__setattr__(self, "_size", 1 if alone else dist.get_world_size(self.group))
        object.__setattr__(self, "_rank", 0 if alone else dist.get_rank(self.group))

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank


# ------------------------------------------------------------------------------ helpers


def _record(comm: GroupComm, op: OpName, payload: Tensor, tag: str, phase: Phase) -> None:
    comm.ledger.record(
        op, comm.name, phase, payload.numel() * payload.element_size(), payload.numel(), tag
    )


@contextmanager
def _collective(comm: GroupComm, op: str, tag: str, payload: Tensor) -> Iterator[None]:
    """Time the call into the ledger and label it ``{group}.{op}.{tag}`` in profiler traces."""
    with torch.profiler.record_function(f"{comm.name}.{op}.{tag}"):
        with comm.ledger.timed(comm.name, payload.device):
            yield


def _chunk_len(shape: torch.Size, dim: int, comm: GroupComm, tag: str) -> int:
    if shape[dim] % comm.size != 0:
        raise ValueError(
            f"[{tag}] cannot split dim {dim} of size {shape[dim]} (shape {tuple(shape)}) "
            f"evenly across the {comm.size} ranks of group '{comm.name}'"
        )
    return shape[dim] // comm.size


def _all_reduce(x: Tensor, comm: GroupComm, tag: str, phase: Phase) -> Tensor:
    """Sum ``x`` across the group into a fresh tensor (never mutates an autograd input)."""
    out = x.clone(memory_format=torch.contiguous_format)
    _record(comm, "all_reduce", out, tag, phase)
    with _collective(comm, "all_reduce", tag, out):
        dist.all_reduce(out, group=comm.group)
    return out


def _all_gather(x: Tensor, dim: int, comm: GroupComm, tag: str, phase: Phase) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    x = x.contiguous()
    flat = x.new_empty(comm.size * x.numel())  # 1-D buffers: every backend accepts them
    _record(comm, "all_gather", flat, tag, phase)
    with _collective(comm, "all_gather", tag, flat):
        _all_gather_flat(flat, x.view(-1), group=comm.group)
    # [W, ..., n_dim, ...] -> [..., W * n_dim, ...]: rank-major, i.e. torch.cat order.
    stacked = flat.view(comm.size, *x.shape)
    return stacked.movedim(0, dim).flatten(dim, dim + 1).contiguous()


def _reduce_scatter(x: Tensor, dim: int, comm: GroupComm, tag: str, phase: Phase) -> Tensor:
    """Sum ``x`` across the group and keep this rank's chunk along ``dim``."""
    n = _chunk_len(x.shape, dim, comm, tag)
    # [..., W * n, ...] -> [W, ..., n, ...] so each rank's chunk is one flat block.
    stacked = x.unflatten(dim, (comm.size, n)).movedim(dim, 0).contiguous()
    out = x.new_empty(stacked.shape[1:])
    _record(comm, "reduce_scatter", stacked, tag, phase)
    with _collective(comm, "reduce_scatter", tag, out):
        _reduce_scatter_flat(out.view(-1), stacked.view(-1), group=comm.group)
    return out


def _all_to_all(
    x: Tensor, send: list[int], recv: list[int], comm: GroupComm, tag: str, phase: Phase
) -> Tensor:
    """Rows ``send[i]`` of ``x`` (in order) to rank ``i``; ``recv[i]`` rows back from it.

    The ledger gets the whole input, the chunk the rank keeps included: the cost model's
    bytes are what the call is handed, as for every other op here.
    """
    x = x.contiguous()
    out = x.new_empty(sum(recv), *x.shape[1:])
    _record(comm, "all_to_all", x, tag, phase)
    with _collective(comm, "all_to_all", tag, x):
        dist.all_to_all_single(out, x, recv, send, group=comm.group)
    return out


def _local_chunk(x: Tensor, dim: int, comm: GroupComm, tag: str) -> Tensor:
    n = _chunk_len(x.shape, dim, comm, tag)
    return x.narrow(dim, comm.rank * n, n).contiguous()


# ------------------------------------------------------------------ autograd Functions


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward.

    Ends a row-parallel region: the output is replicated, and d(sum)/d(partial) is the
    identity, so each rank's partial simply receives the (replicated) output gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm, tag: str) -> Tensor:  # type: ignore[override]
        return _all_reduce(x, comm, tag, comm.ledger.forward_phase)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward depends on what consumes the output.

    ``split``: the consumer is replicated (every rank computes the same loss), so each
    rank's gradient already is the full gradient and the rank just keeps its slice.
    ``reduce_scatter``: ranks consume the gathered tensor differently (e.g. a
    vocab-parallel head), so the gradients are partials that must be summed first.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, comm: GroupComm, tag: str, dim: int, grad: GradMode
    ) -> Tensor:
        ctx.comm, ctx.tag, ctx.dim, ctx.grad_mode = comm, tag, dim, grad
        return _all_gather(x, dim, comm, tag, comm.ledger.forward_phase)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        if ctx.grad_mode == "split":
            out = _local_chunk(grad, ctx.dim, ctx.comm, ctx.tag)
        else:
            out = _reduce_scatter(grad, ctx.dim, ctx.comm, ctx.tag, "bwd")
        return out, None, None, None, None


class _ScatterToGroup(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward (no comm), all-gather backward.

    The input is replicated and each slice feeds a different rank, so the full
    gradient is the concatenation of every rank's slice gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm, tag: str, dim: int) -> Tensor:  # type: ignore[override]
        ctx.comm, ctx.tag, ctx.dim = comm, tag, dim
        return _local_chunk(x, dim, comm, tag)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.comm, ctx.tag, "bwd"), None, None, None


class _ReduceScatterToGroup(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward.

    Turns per-rank partial sums of a full tensor into the rank's slice of the total;
    each rank's partial influenced every slice, so its gradient is the full gathered
    gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm, tag: str, dim: int) -> Tensor:  # type: ignore[override]
        ctx.comm, ctx.tag, ctx.dim = comm, tag, dim
        return _reduce_scatter(x, dim, comm, tag, comm.ledger.forward_phase)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.comm, ctx.tag, "bwd"), None, None, None


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all forward; the reverse all-to-all (splits swapped) backward.

    The permutation of rows it makes is its own adjoint's inverse: the gradient of a row
    that went to rank ``j`` comes back from rank ``j`` to the slot it left.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, send: list[int], recv: list[int], comm: GroupComm, tag: str
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.comm, ctx.tag = send, recv, comm, tag
        return _all_to_all(x, send, recv, comm, tag, comm.ledger.forward_phase)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        return (
            _all_to_all(grad, ctx.recv, ctx.send, ctx.comm, ctx.tag, "bwd"),
            None,
            None,
            None,
            None,
        )


class PendingAllReduce:
    """An input-gradient all-reduce started early and finished where the blocking one runs.

    A column-parallel B's backward knows its partial input gradient before it computes its
    weight gradient; :meth:`start` sends the former off asynchronously so the GEMM for the
    latter runs while the ranks exchange it (Megatron's asynchronous input-gradient
    all-reduce). :meth:`finish` is called by :func:`copy_to_group`'s backward, the
    place the blocking all-reduce sits otherwise, and waits. Same bytes, same ledger record,
    same order of collectives on every rank; only the waiting moves.
    """

    def __init__(self, comm: GroupComm, tag: str):
        self.comm, self.tag = comm, tag
        self._work: dist.Work | None = None
        self._buf: Tensor | None = None

    def start(self, grad: Tensor) -> None:
        buf = grad.contiguous()
        comm = self.comm
        _record(comm, "all_reduce", buf, self.tag, "bwd")
        with _collective(comm, "all_reduce", self.tag, buf):
            self._work = dist.all_reduce(buf, group=comm.group, async_op=True)
        self._buf = buf

    def finish(self, grad: Tensor) -> Tensor:
        """The summed gradient: the started one's result, else a blocking all-reduce."""
        if self._buf is None:
            return _all_reduce(grad, self.comm, self.tag, "bwd")
        out, work = self._buf, self._work
        with _collective(self.comm, "wait", self.tag, out):
            if work is not None:
                work.wait()
        self._work, self._buf = None, None
        return out.view_as(grad)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward.

    Used where a replicated activation enters a region whose ranks compute different
    partial results (column-parallel): every rank's gradient w.r.t. the shared input
    is only its partial contribution, so the true gradient is their sum. It is the
    adjoint of :class:`_ReduceFromGroup`. The backward finishes ``pending``: a blocking
    all-reduce, unless the region's consumer started it early.
    """

    @staticmethod
    def forward(ctx, x: Tensor, pending: PendingAllReduce) -> Tensor:  # type: ignore[override]
        ctx.pending = pending
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return ctx.pending.finish(grad), None


# ------------------------------------------------------------------ public wrappers


@torch.compiler.disable
def _eager(function: type[torch.autograd.Function], *args: object) -> Tensor:
    """Run a collective outside any ``torch.compile`` graph.

    Every collective is a compile boundary: a compiled block breaks its graph exactly here,
    so each collective-free region (BTP's, by construction) compiles whole and the
    collectives, their ledger records and timing stay eager Python.
    """
    return function.apply(*args)


def copy_to_group(x: Tensor, comm: GroupComm, tag: str) -> Tensor:
    """Identity forward, all-reduce backward (enter a column-parallel region)."""
    if comm.size == 1:
        return x
    return _eager_copy_to_group(x, PendingAllReduce(comm, tag))


def copy_to_group_pending(x: Tensor, pending: PendingAllReduce) -> Tensor:
    """:func:`copy_to_group` whose backward all-reduce the consumer may start early."""
    if pending.comm.size == 1:
        return x
    return _eager_copy_to_group(x, pending)


@torch.compiler.disable
def _eager_copy_to_group(x: Tensor, pending: PendingAllReduce) -> Tensor:
    return _CopyToGroup.apply(x, pending)


def reduce_from_group(x: Tensor, comm: GroupComm, tag: str) -> Tensor:
    """All-reduce (sum) forward, identity backward (leave a row-parallel region)."""
    if comm.size == 1:
        return x
    return _eager(_ReduceFromGroup, x, comm, tag)


def gather_from_group(
    x: Tensor, comm: GroupComm, tag: str, dim: int = -1, grad: GradMode = "split"
) -> Tensor:
    """All-gather along ``dim``; backward keeps the slice or reduce-scatters (see class)."""
    if grad not in ("split", "reduce_scatter"):
        raise ValueError(f"[{tag}] grad must be 'split' or 'reduce_scatter', got {grad!r}")
    if comm.size == 1:
        return x
    return _eager(_GatherFromGroup, x, comm, tag, dim % x.dim(), grad)


def scatter_to_group(x: Tensor, comm: GroupComm, tag: str, dim: int = -1) -> Tensor:
    """This rank's slice along ``dim`` (no comm) forward, all-gather backward."""
    if comm.size == 1:
        return x
    return _eager(_ScatterToGroup, x, comm, tag, dim % x.dim())


def reduce_scatter_to_group(x: Tensor, comm: GroupComm, tag: str, dim: int = -1) -> Tensor:
    """Reduce-scatter along ``dim`` forward, all-gather backward."""
    if comm.size == 1:
        return x
    return _eager(_ReduceScatterToGroup, x, comm, tag, dim % x.dim())


@torch.compiler.disable
def all_reduce_(
    x: Tensor, comm: GroupComm, tag: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Tensor:
    """In-place all-reduce outside autograd, for statistics (e.g. the vocab-parallel max).

    Returns ``x``. The caller treats the result as a constant (detach first); it is
    recorded as ``fwd``, or ``recompute`` inside :meth:`CommLedger.recompute`.
    """
    if comm.size == 1:
        return x
    buf = x if x.is_contiguous() else x.contiguous()
    _record(comm, "all_reduce", buf, tag, comm.ledger.forward_phase)
    with _collective(comm, "all_reduce", tag, buf):
        dist.all_reduce(buf, op=op, group=comm.group)
    if buf is not x:
        x.copy_(buf)
    return x


@torch.compiler.disable
def gather_counts(counts: Tensor, comm: GroupComm, tag: str) -> Tensor:
    """Every rank's ``counts [size, n]`` (int64): ``[source, size, n]``, the same on all ranks.

    The count half of a variable all-to-all when every rank must know every rank's sends
    (a receive bound decided alike everywhere, :mod:`boostlr.parallel.ep_bound`): one
    fixed-shape all-gather (an all-to-all of the counts would give each rank only its own
    column, ``[source, n]``, and the bound needs them all). Not differentiable. The ledger
    records the gathered output, as for every all-gather here.
    """
    if counts.dim() != 2 or counts.shape[0] != comm.size:
        raise ValueError(
            f"[{tag}] counts must be [{comm.size}, n] for group '{comm.name}', got "
            f"{tuple(counts.shape)}"
        )
    if comm.size == 1:
        return counts.unsqueeze(0)
    send = counts.contiguous()
    out = send.new_empty(comm.size * send.numel())
    _record(comm, "all_gather", out, f"{tag}.counts", comm.ledger.forward_phase)
    with _collective(comm, "all_gather", f"{tag}.counts", out):
        _all_gather_flat(out, send.view(-1), group=comm.group)
    return out.view(comm.size, *send.shape)


def all_to_all_single(
    x: Tensor, send: list[int], recv: list[int], comm: GroupComm, tag: str
) -> Tensor:
    """Rows ``send[i]`` of ``x [rows, ...]`` to rank ``i``, ``recv[i]`` rows from it, in
    rank order; backward sends the gradients back (splits swapped).

    ``send`` and ``recv`` are host lists, read from the exchanged counts
    (:func:`gather_counts`).
    """
    if len(send) != comm.size or len(recv) != comm.size or sum(send) != x.shape[0]:
        raise ValueError(
            f"[{tag}] splits {send} -> {recv} do not fit {x.shape[0]} rows over the "
            f"{comm.size} ranks of group '{comm.name}'"
        )
    if comm.size == 1:
        return x
    return _eager(_AllToAll, x, list(send), list(recv), comm, tag)
