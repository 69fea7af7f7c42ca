"""Autograd-aware tensor-parallel collectives and the communication ledger.

Every collective in boostlr goes through this module (docs/design.md §3) so that

* each primitive is a conjugate pair: whatever the forward does to the activation,
  the backward does the adjoint to its gradient (all-reduce <-> identity,
  all-gather <-> take-slice / reduce-scatter);
* a group of size 1 costs nothing and records nothing, so the single-device model
  and the TP model run the same code;
* every call lands in a :class:`CommLedger` with its payload, so per-step totals can
  be logged and checked against the cost model.

Process groups are always passed explicitly through a :class:`GroupComm`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

Phase = Literal["fwd", "bwd", "recompute"]
OpName = Literal["all_reduce", "all_gather", "reduce_scatter", "send"]
GradMode = Literal["split", "reduce_scatter"]

PHASES: tuple[Phase, ...] = ("fwd", "bwd", "recompute")
OPS: tuple[OpName, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")

# Recent torch (2.13 here) renamed the flat-tensor collectives to *_single and deprecated
# the old names; older torch (>= 2.6) only has the old ones. Same (output, input, ...)
# signature; gloo implements both natively, so no all_reduce/list-based fallback is needed.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by one rank; ``bytes`` is that rank's payload."""

    op: str
    group: str
    phase: str
    bytes: int
    elements: int
    tag: str


@dataclass(eq=False)
class CommLedger:
    """Append-only log of collective calls, reset once per training step.

    The phase of a forward-direction collective is ``fwd`` unless it runs inside
    :meth:`recompute`, which is how activation checkpointing's re-forward is told
    apart: low-rank checkpointing must show zero recompute bytes, block
    checkpointing under vanilla/Megatron TP re-issues every forward all-reduce.
    """

    records: list[CommRecord] = field(default_factory=list)
    _recompute_depth: int = field(default=0, init=False, repr=False)
    _seconds: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _events: list[tuple[str, Any, Any]] = field(default_factory=list, init=False, repr=False)

    def record(
        self, op: str, group: str, phase: str, bytes: int, elements: int, tag: str = ""
    ) -> CommRecord:
        if op not in OPS:
            raise ValueError(f"unknown collective op {op!r}; expected one of {OPS}")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        rec = CommRecord(op, group, phase, int(bytes), int(elements), tag)
        self.records.append(rec)
        return rec

    def reset(self) -> None:
        self.records.clear()
        self._seconds.clear()
        self._events.clear()

    @contextmanager
    def timed(self, group: str, device: torch.device) -> Iterator[None]:
        """Measure the time this rank is blocked by the collective (or wait) inside.

        CPU backends (gloo) block the host for the whole call: wall time. On CUDA the host
        only enqueues; events on the current stream measure how long the stream stalls on
        the communication (a synchronous NCCL call makes it wait on the NCCL stream), read
        back by :meth:`seconds` once the step has been synchronised.
        """
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((group, start, end))
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add_seconds(group, time.perf_counter() - started)

    def _add_seconds(self, group: str, seconds: float) -> None:
        self._seconds[group] = self._seconds.get(group, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        """Seconds blocked in collectives since :meth:`reset`, per group name."""
        for group, start, end in self._events:
            end.synchronize()
            self._add_seconds(group, start.elapsed_time(end) / 1e3)
        self._events.clear()
        return dict(self._seconds)

    @property
    def forward_phase(self) -> Phase:
        """Phase to stamp on a forward-direction collective issued right now."""
        return "recompute" if self._recompute_depth > 0 else "fwd"

    @contextmanager
    def recompute(self) -> Iterator[None]:
        """Mark forward-direction collectives issued inside as ``recompute``.

        Meant as the recompute half of ``torch.utils.checkpoint``'s ``context_fn``:
        ``context_fn=lambda: (nullcontext(), ledger.recompute())``.
        """
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1

    def totals(self, group: str | None = None) -> dict[str, int]:
        """Calls, elements and bytes (also bytes per phase), optionally for one group."""
        out = {"calls": 0, "elements": 0, "bytes": 0} | {f"bytes_{p}": 0 for p in PHASES}
        for rec in self.records:
            if group is not None and rec.group != group:
                continue
            out["calls"] += 1
            out["elements"] += rec.elements
            out["bytes"] += rec.bytes
            out[f"bytes_{rec.phase}"] += rec.bytes
        return out

    def step_metrics(self, prefix: str = "comm_tp", group: str | None = "tp") -> dict[str, int]:
        """The per-step metrics-log entries for one group (zeros when nothing ran)."""
        t = self.totals(group)
        keys = ("bytes", "calls", "bytes_fwd", "bytes_bwd", "bytes_recompute")
        return {f"{prefix}_{k}": t[k] for k in keys}


@dataclass(frozen=True)
class GroupComm:
    """A process group plus the name and ledger its collectives are recorded under.

    ``group=None`` means "no parallelism here" (size 1), never "the default group":
    groups are always explicit so DP/PP/TP traffic cannot be mixed up.
    """

    group: dist.ProcessGroup | None
    name: str
    ledger: CommLedger
    # A gloo group of two ranks sums, gathers and scatters by one direct exchange with the
    # peer (see :func:`_exchange`); off: gloo's own collectives.
    pair_exchange: bool = True
    # Read once: a plain attribute is what torch.compile can trace (and guard on) in the
    # ``size == 1`` shortcuts below, where a process-group query would break the graph.
    _size: int = field(init=False, repr=False, compare=False)
    _rank: int = field(init=False, repr=False, compare=False)
    _peer: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alone = self.group is None or not dist.is_available() or not dist.is_initialized()
        size = 1 if alone else dist.get_world_size(self.group)
        rank = 0 if alone else dist.get_rank(self.group)
        pair = self.pair_exchange and size == 2 and dist.get_backend(self.group) == "gloo"
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_rank", rank)
        peer = dist.get_global_rank(self.group, 1 - rank) if pair else None
        object.__setattr__(self, "_peer", peer)

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def peer(self) -> int | None:
        """The other rank's global rank when collectives go by pair exchange, else ``None``."""
        return self._peer


def _record(comm: GroupComm, op: OpName, payload: Tensor, tag: str, phase: Phase) -> None:
    comm.ledger.record(
        op, comm.name, phase, payload.numel() * payload.element_size(), payload.numel(), tag
    )


_LABEL_OPS = frozenset((*OPS, "wait"))


def is_collective_label(label: str) -> bool:
    """Whether a profiler label ``{group}.{op}.{tag}`` names one of this module's collectives.

    Why: the op census (``analysis/census.py``) counts every op dispatched inside such a call
    as the collective's own work (a pair exchange's receive buffer and sum, as gloo's ring
    sums inside its C++), not as the model's element-wise kernels.
    """
    parts = label.split(".", 2)
    return len(parts) == 3 and parts[1] in _LABEL_OPS


@contextmanager
def _collective(comm: GroupComm, op: str, tag: str, payload: Tensor) -> Iterator[None]:
    """Time the call into the ledger and label it ``{group}.{op}.{tag}`` in profiler traces.

    Everything that depends on the algorithm (gloo's ring or a pair exchange: flat views of
    the buffers, the receive buffer, the local sum) runs inside, so the op census counts the
    same model ops whichever one moves the bytes.
    """
    with torch.profiler.record_function(f"{comm.name}.{op}.{tag}"):
        with comm.ledger.timed(comm.name, payload.device):
            yield


def _exchange(send: Tensor, recv: Tensor, comm: GroupComm) -> list[dist.Work]:
    """Post the send of ``send`` to the peer and the receive of its tensor into ``recv``.

    Why: on one host gloo's ring all-reduce of a 1-3 MB tensor between two ranks takes ~3x a
    direct exchange of the same bytes (benchmarks/pair_exchange.py). For a pair the exchange
    *is* the optimal algorithm: each rank sends its N bytes once (the ring's 2(W-1)/W·N) and
    adds locally, and ``a + b == b + a`` in IEEE arithmetic, so both ranks get bitwise the
    sum gloo's all-reduce returns. Point-to-point messages between two ranks are matched in
    the order they are posted, which every rank does identically.
    """
    assert comm.peer is not None
    if send.numel() == 0 and recv.numel() == 0:
        return []  # same shapes on both ranks: both skip
    return [
        dist.isend(send, comm.peer, group=comm.group),
        dist.irecv(recv, comm.peer, group=comm.group),
    ]


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _pair_all_reduce_(x: Tensor, comm: GroupComm, op: dist.ReduceOp.RedOpType) -> None:
    """In-place all-reduce of a contiguous ``x`` by exchange (SUM or MAX)."""
    other = torch.empty_like(x)
    _wait(_exchange(x, other, comm))
    if op == dist.ReduceOp.MAX:
        torch.maximum(x, other, out=x)
    else:
        x.add_(other)


def transport_all_reduce_(
    x: Tensor, comm: GroupComm, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> None:
    """Reduce a contiguous ``x`` in place the way the group's recorded all-reduces do (a pair
    exchange for SUM/MAX where the group has one, else the backend's own), with no ledger
    record or label: also what ``boostlr calibrate`` times as the link."""
    if comm.peer is not None and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        _pair_all_reduce_(x, comm, op)
    else:
        dist.all_reduce(x, op=op, group=comm.group)


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
        transport_all_reduce_(out, comm)
    return out


def _all_gather(x: Tensor, dim: int, comm: GroupComm, tag: str, phase: Phase) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    x = x.contiguous()
    flat = x.new_empty(comm.size * x.numel())  # 1-D buffers: every backend accepts them
    _record(comm, "all_gather", flat, tag, phase)
    with _collective(comm, "all_gather", tag, flat):
        if comm.peer is not None:
            slots = flat.view(comm.size, -1)
            slots[comm.rank].copy_(x.view(-1))
            _wait(_exchange(x.view(-1), slots[1 - comm.rank], comm))
        else:
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
        if comm.peer is not None:
            _wait(_exchange(stacked[1 - comm.rank], out, comm))
            out.add_(stacked[comm.rank])
        else:
            _reduce_scatter_flat(out.view(-1), stacked.view(-1), group=comm.group)
    return out


def _local_chunk(x: Tensor, dim: int, comm: GroupComm, tag: str) -> Tensor:
    n = _chunk_len(x.shape, dim, comm, tag)
    return x.narrow(dim, comm.rank * n, n).contiguous()


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
        self._works: list[dist.Work] = []
        self._buf: Tensor | None = None
        self._other: Tensor | None = None  # the peer's partial, under pair exchange

    def start(self, grad: Tensor) -> None:
        buf = grad.contiguous()
        comm = self.comm
        _record(comm, "all_reduce", buf, self.tag, "bwd")
        with _collective(comm, "all_reduce", self.tag, buf):
            if comm.peer is not None:
                self._other = torch.empty_like(buf)
                self._works = _exchange(buf, self._other, comm)
            else:
                self._works = [dist.all_reduce(buf, group=comm.group, async_op=True)]
        self._buf = buf

    def finish(self, grad: Tensor) -> Tensor:
        """The summed gradient: the started one's result, else a blocking all-reduce."""
        if self._buf is None:
            return _all_reduce(grad, self.comm, self.tag, "bwd")
        out, other = self._buf, self._other
        with _collective(self.comm, "wait", self.tag, out):
            _wait(self._works)
            if other is not None:
                out.add_(other)
        self._works, self._buf, self._other = [], None, None
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
        transport_all_reduce_(buf, comm, op)
    if buf is not x:
        x.copy_(buf)
    return x
