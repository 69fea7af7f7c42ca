"""Count what a training step dispatches: aten ops and the bytes they move.

:class:`OpCensus` is a ``TorchDispatchMode``: every aten op that reaches the dispatcher below
autograd is classified and counted, per phase (``fwd`` / ``bwd``, set by the caller):

* ``gemm`` (``mm``, ``bmm``), ``attention`` (the SDPA kernels), ``comm`` (c10d ops, when they
  reach Python dispatch at all, and every op dispatched inside one of boostlr's collectives:
  a pair exchange's receive buffer and local sum are the all-reduce's work, as gloo's ring
  sums inside its C++);
* ``kernel``: any other op that writes memory (a fresh result or a mutated operand);
* ``view``: an op whose results all alias an operand (``view``, ``t``, ``detach``,
  ``_unsafe_view``, ...): dispatched, but moving no data.

Bytes: every tensor operand is read once, every fresh result and every mutated operand is
written once; except where that convention would count memory an op does not touch: a
gather (embedding, ``gather``, ``index``, ``nll_loss``) reads the elements it returns, an
allocation touches nothing, ``copy_`` / ``fill_`` do not read their destination. A DTensor
operand counts its local shard (the memory this rank touches), not its global shape.

A CPU tool, not part of the package (the cost model does not import it): run it to compare
the cost model's element-wise bytes and kernel estimate (``analysis/gemms.py``) with what
torch dispatches for one block of each strategy at TP 1 (``python benchmarks/census.py``).
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from boostlr.parallel.ledger import OPS  # a CPU tool: it may read the engine

GEMMS = ("aten.mm.default", "aten.mm.out", "aten.bmm.default", "aten.addmm.default")
INDEXING = (
    "aten.embedding.default",
    "aten.gather.default",
    "aten.index.Tensor",
    "aten.index_put_.default",
    "aten.nll_loss_forward.default",
)
ALLOCATIONS = (
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> int | None:
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def kind_of(name: str, fresh: bool) -> str:
    if name in GEMMS:
        return "gemm"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith(("c10d.", "_c10d_functional.")):
        return "comm"
    if name.startswith("profiler."):  # record_function: host work, no data
        return "view"
    return "kernel" if fresh else "view"


def tensor_operands(func, args: tuple, kwargs: dict) -> list[tuple[bool, list[torch.Tensor]]]:
    """Each argument of an aten op as ``(written in place, its tensors)``, from the schema."""
    schema = func._schema.arguments
    bound = list(zip(schema, args, strict=False))
    bound += [(a, kwargs[a.name]) for a in schema if a.name in kwargs]
    return [
        (
            a.alias_info is not None and a.alias_info.is_write,
            [t for t in tree_leaves(value) if torch.is_tensor(t)],
        )
        for a, value in bound
    ]


def _is_collective_label(label: str) -> bool:
    parts = label.split(".", 2)
    return len(parts) == 3 and parts[1] in (*OPS, "wait")


class OpCensus(TorchDispatchMode):
    """Ops and bytes by ``(phase, kind)``; set ``phase`` between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.ops: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.by_name: collections.Counter = collections.Counter()
        self.bytes_by_name: collections.Counter = collections.Counter()
        # Open record_function scopes, innermost last (they nest): is each a collective's?
        self._scopes: list[bool] = []

    def _track_scope(self, name: str, args: tuple) -> None:
        """Ops inside a collective's profiler scope (``{group}.{op}.{tag}``) are its own work
        (flat views of the buffers), as gloo's sums inside its C++ are."""
        if name.startswith("profiler._record_function_enter"):
            self._scopes.append(isinstance(args[0], str) and _is_collective_label(args[0]))
        elif name.startswith("profiler._record_function_exit") and self._scopes:
            self._scopes.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: list[torch.Tensor] = []
        mutated: list[torch.Tensor] = []
        out_variant = func._schema.overload_name == "out"  # ``out=`` is written, not read
        for written, tensors in tensor_operands(func, args, kwargs):
            if not (written and out_variant):
                inputs += tensors
            if written:
                mutated += tensors
        results = [t for t in tree_leaves(out) if torch.is_tensor(t)]
        storages = {_storage(t) for t in inputs + mutated}
        fresh = [t for t in results if _storage(t) not in storages]
        name = str(func)
        kind = kind_of(name, bool(fresh or mutated or not results))
        if any(self._scopes) and not name.startswith("profiler."):
            kind = "comm"
        self._track_scope(name, args)
        moved = 0
        if name in INDEXING:  # the elements gathered (or scattered) and the indices, not all
            index = [t for t in inputs if not t.is_floating_point()]
            data = fresh if name != "aten.index_put_.default" else inputs[2:3]
            moved = sum(map(_nbytes, index)) + 2 * sum(map(_nbytes, data))
        elif name == "aten.nll_loss_backward.default":  # writes the (mostly zero) gradient
            moved = sum(map(_nbytes, fresh))
        elif name in ALLOCATIONS:  # memory handed out, not touched
            moved = 0
        elif name in ("aten.copy_.default", "aten.fill_.Scalar", "aten.zero_.default"):
            moved = sum(map(_nbytes, inputs[1:])) + sum(map(_nbytes, mutated))  # dst not read
        elif kind != "view":
            moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, mutated + fresh))
        self.ops[(self.phase, kind)] += 1
        self.bytes[(self.phase, kind)] += moved
        self.by_name[(self.phase, name)] += 1
        self.bytes_by_name[(self.phase, name)] += moved
        return out

    def count(self, phase: str, *kinds: str) -> int:
        return sum(self.ops[(phase, k)] for k in kinds)

    def moved(self, phase: str, *kinds: str) -> int:
        return sum(self.bytes[(phase, k)] for k in kinds)


def census_backward(census: OpCensus, outputs: list[torch.Tensor]) -> None:
    """Backward from ``outputs`` (seeds of ones, made outside the census) under ``census``."""
    outputs = [t for t in outputs if t is not None and t.requires_grad]
    seeds = [torch.ones_like(t) for t in outputs]
    census.phase = "bwd"
    with census:
        torch.autograd.backward(outputs, seeds)


def _one_block(arch: str, layers: int, dim: int, seq: int) -> dict:
    """Kernels and bytes of a whole one-device step with ``layers`` blocks (fp32)."""
    from boostlr.config import build_config
    from boostlr.parallel.engine import ParallelModel

    over = {"model.preset": "tiny", "model.arch": arch, "model.n_layers": layers}
    over |= {"model.dim": dim, "model.ffn_dim": 8 * dim // 3, "model.vocab_size": 256}
    over |= {"data.seq_len": seq, "train.batch_size": 2}
    cfg = build_config(overrides=[(k, str(v)) for k, v in over.items()])
    part = ParallelModel.build(cfg, torch.device("cpu")).stages[0]
    tokens = torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    part(tokens[:, :-1], targets=tokens[:, 1:]).backward()  # warm
    part.zero_grad(set_to_none=True)
    census = OpCensus()
    with census:
        loss = part(tokens[:, :-1], targets=tokens[:, 1:])
    census_backward(census, [loss])
    return {p: (census.count(p, "kernel"), census.moved(p, "kernel")) for p in ("fwd", "bwd")}


def main() -> None:
    """One block at one device (a 2-block step minus a 1-block one) against the cost model."""
    from boostlr.analysis.gemms import block_elementwise, block_kernels
    from boostlr.config import build_config

    dim, seq = 256, 64
    print(f"# census: one block, one device, fp32, d {dim}, 2 x {seq} tokens")
    print(f"{'arch':<6}{'phase':<6}{'kernels':>9}{'model':>7}{'MB':>9}{'model MB':>10}")
    for arch in ("full", "cola", "svd", "lax"):
        one, two = _one_block(arch, 1, dim, seq), _one_block(arch, 2, dim, seq)
        over = [("model.preset", "tiny"), ("model.arch", arch), ("model.dim", str(dim))]
        m = build_config(overrides=[*over, ("model.ffn_dim", str(8 * dim // 3))]).model
        kernels = block_kernels(m, None, 1, 1)
        ew = block_elementwise(m, None, 1, 2 * seq, 4, 1)
        for i, phase in enumerate(("fwd", "bwd")):
            n, nbytes = two[phase][0] - one[phase][0], two[phase][1] - one[phase][1]
            model_bytes = (ew.fwd, ew.bwd)[i]
            print(
                f"{arch:<6}{phase:<6}{n:>9}{kernels[i]:>7}{nbytes / 1e6:>9.2f}"
                f"{model_bytes / 1e6:>10.2f}"
            )


if __name__ == "__main__":
    main()
