"""Data parallelism over the mesh's ``dp`` dim with FSDP2 (``fully_shard``), docs/design.md §4.

``fsdp`` reshards parameters after forward (ZeRO-3-like); ``ddp`` keeps them gathered from
forward to backward and only reduce-scatters gradients (ZeRO-2-like: torch's DDP refuses
multi-dimensional meshes). Parameters arrive as DTensors on the ``tp`` dim, so FSDP takes its
2-D path and gradients, norms and checkpoints see global shapes. FSDP's collectives bypass
:mod:`boostlr.parallel.collectives`; they are recorded in the ledger through FSDP's custom
all-gather / reduce-scatter hooks, with the same payload convention (the full buffer), and
timed there: on CPU (gloo) the calls block the host, so their wall time is the time blocked;
on CUDA they run on FSDP's own streams, so the events measure their duration there (an upper
bound of what the compute stream waits for). An asynchronous call (FSDP's explicit
``unshard(async_op=True)``) is timed where its work is waited on. On gloo the hooks also
run the collectives in place (:func:`in_place_collectives`); the ledger still records the
all-gather and reduce-scatter FSDP asked for.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from boostlr._torch_internals import DefaultAllGather, DefaultReduceScatter, in_backward
from boostlr.models.moe import moe_layers
from boostlr.parallel.collectives import GroupComm
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.platform import fsdp_in_place_collectives
from boostlr.specs.moe import is_routed_expert


def _phase(comm: GroupComm) -> str:
    """``bwd`` inside the autograd engine (FSDP's pre-backward re-gather, gradient reduction)."""
    return "bwd" if in_backward() else comm.ledger.forward_phase


class _TimedWork(dist.Work):
    """An asynchronous collective whose ``wait`` is timed into the ledger."""

    def __init__(self, work: dist.Work, comm: GroupComm, device: torch.device, label: str):
        super().__init__()
        self.work, self.comm, self.device, self.label = work, comm, device, label

    def wait(self, timeout=None) -> bool:  # type: ignore[override]
        with _timed(self.comm, self.device, self.label):
            return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextmanager
def _timed(comm: GroupComm, device: torch.device, label: str):
    with torch.profiler.record_function(label), comm.ledger.timed(comm.name, device):
        yield


def _call_timed(comm: GroupComm, device: torch.device, label: str, call, async_op: bool):
    if async_op:
        work = call()
        return None if work is None else _TimedWork(work, comm, device, label)
    with _timed(comm, device, label):
        return call()


class _AllWorks(dist.Work):
    """Several asynchronous collectives waited on as one, then ``then`` (if any)."""

    def __init__(self, works: list[dist.Work], then=None):
        super().__init__()
        self.works, self.then = works, then

    def wait(self, timeout=None) -> bool:  # type: ignore[override]
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        if self.then is not None:
            self.then()
            self.then = None
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def in_place_all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """All-gather as one broadcast per rank straight into its slot of ``output``.

    gloo's ``all_gather_into_tensor`` gathers into a temporary the size of ``output`` and
    copies it over; the broadcasts write in place and move the same bytes.
    """
    world = dist.get_world_size(group)
    slots = output.view(world, -1)
    own = slots[dist.get_rank(group)]
    if own.data_ptr() != shard.data_ptr():  # FSDP copies its shard into the slot already
        own.copy_(shard.view(-1))
    works = [
        dist.broadcast(slots[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
        for r in range(world)
    ]
    all_works = _AllWorks(works)
    if async_op:
        return all_works
    all_works.wait()
    return None


def in_place_reduce_scatter(
    output: torch.Tensor,
    staging: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp,
    async_op: bool,
) -> dist.Work | None:
    """Reduce-scatter as an in-place all-reduce of FSDP's staging buffer, then a slot copy.

    gloo's ``reduce_scatter_tensor`` works on a copy of the whole input; FSDP owns
    ``staging`` and reads nothing of it after the call, so reducing it in place allocates
    nothing. ``staging`` is consumed: once the own slot is copied out its memory is released
    (:func:`release_storage`). FSDP keeps a reference to it until a later unit's backward (so
    that a CUDA allocator does not hand it to another stream early); on a host-blocking
    collective that reference would hold a dead gradient-sized buffer through the next
    unit's backward, or past a pipeline micro-batch into the next forward.
    """
    world = dist.get_world_size(group)
    work = dist.all_reduce(staging, op=op, group=group, async_op=True)

    def copy_own_slot() -> None:
        output.copy_(staging.view(world, -1)[dist.get_rank(group)].view_as(output))
        release_storage(staging)

    all_works = _AllWorks([work], copy_own_slot)
    if async_op:
        return all_works
    all_works.wait()
    return None


def release_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s memory now (its storage shrinks to nothing), if it owns all of it.

    A view into a larger storage is left alone: other tensors may still use that memory.
    """
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size():
        storage.resize_(0)


class _RecordedAllGather(DefaultAllGather):
    def __init__(self, comm: GroupComm, in_place: bool):
        self.comm, self.in_place = comm, in_place
        # The flat buffer of this unit's last gather, to release after FSDP's copy-out.
        self.gathered: weakref.ref[torch.Tensor] | None = None

    def release_gathered(self) -> None:
        """Free the flat all-gather buffer FSDP has copied out and keeps for stream ordering.

        In forward FSDP holds the flat buffer of a unit until the next unit's copy-out (until
        the end of the forward for the last unit: the LM head), so that on CUDA the next
        all-gather overlaps this copy-out. Gathers here block the host, so by the time the
        unit's forward starts the buffer is dead. Only outside the autograd engine: there a
        prefetched gather may still be writing into it.
        """
        gathered = self.gathered() if self.gathered is not None else None
        self.gathered = None
        if gathered is not None and not in_backward():
            release_storage(gathered)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = output_tensor.numel()
        self.comm.ledger.record(
            "all_gather",
            self.comm.name,
            _phase(self.comm),
            n * output_tensor.element_size(),
            n,
            "fsdp_params",
        )
        if self.in_place:
            self.gathered = weakref.ref(output_tensor)
        call = in_place_all_gather if self.in_place else super().__call__
        return _call_timed(
            self.comm,
            output_tensor.device,
            "dp.all_gather.fsdp_params",
            lambda: call(output_tensor, input_tensor, group, async_op),
            async_op,
        )


class _RecordedReduceScatter(DefaultReduceScatter):
    def __init__(self, comm: GroupComm, in_place: bool):
        self.comm, self.in_place = comm, in_place

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = input_tensor.numel()
        self.comm.ledger.record(
            "reduce_scatter",
            self.comm.name,
            "bwd",
            n * input_tensor.element_size(),
            n,
            "fsdp_grads",
        )
        call = in_place_reduce_scatter if self.in_place else super().__call__
        return _call_timed(
            self.comm,
            output_tensor.device,
            "dp.reduce_scatter.fsdp_grads",
            lambda: call(output_tensor, input_tensor, group, op, async_op),
            async_op,
        )


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.dtype`` (docs/precision.md).

    bfloat16: parameters are all-gathered and computed in bf16 (half the bytes and half the
    gathered memory), gradients reduced in fp32; the sharded fp32 parameters stay the master
    weights the optimizer updates. Inputs and outputs are left alone: the residual stream a
    unit receives is fp32 and stays fp32, as at dp 1 (FSDP's default would cast it to bf16
    at every block), and a stage's outputs already are in their declared boundary dtypes.
    float32: FSDP's default, no casts.
    """
    if dtype != "bfloat16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def apply_data_parallel(
    part: TensorParallelModel, comms: MeshComms, mode: str, dtype: str = "float32"
) -> None:
    """``fully_shard`` each block, then the stage (final norm; a tied embedding too).

    An untied embedding and LM head have their rows split over dp already
    (``part.ctx.vocab_dp``, :mod:`boostlr.parallel.build`): FSDP ignores them. With
    ``parallel.vocab_dp`` off they are units of their own instead: inside the stage's root
    unit they would stay gathered, with their full gradients, through the stage's whole
    backward. A tied table stays in the root unit (one parameter cannot be in two units).
    """
    reshard = mode == "fsdp"
    model = part.model
    vocab = (model.embed_tokens, model.lm_head)
    split = part.ctx.vocab_dp_size > 1
    ignored = {m.weight for m in vocab if m is not None} if split else set()
    policy = mixed_precision(dtype)  # the same for every unit: no unit casts activations
    # Routed experts at ep > 1: units of their own over dp_rep inside their blocks (FSDP's
    # blocks then skip them), or, at dp_rep 1, nothing to shard (docs/moe.md).
    experts = shard_experts_over_dp(model, comms, reshard, policy)
    whole: set[torch.Tensor] = set()  # at dp_rep 1: experts neither FSDP's nor replicated
    if comms.ep.size > 1 and not experts:
        whole = {p for n, p in model.named_parameters() if is_routed_expert(n)}
    own = [] if split or model.cfg.tie_embeddings else [m for m in vocab if m is not None]
    modules = [*model.layers.values(), *own, part]
    for module in modules:
        fully_shard(
            module,
            mesh=comms.dp_mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            ignored_params=((ignored | whole) if module is part else whole) or None,
        )
    in_place = in_place_collectives(comms.dp.group)
    set_fsdp_collectives(modules, comms.dp, in_place)
    if experts:
        set_fsdp_collectives(experts, comms.group("dp_rep"), in_place)


def shard_experts_over_dp(
    model: nn.Module, comms: MeshComms, reshard: bool, policy: MixedPrecisionPolicy
) -> list[nn.Module]:
    """Make each MoE layer's routed experts an FSDP unit over ``dp_rep`` (``ep > 1``).

    Each ep rank holds its ``E / ep`` experts (``Shard(0)`` on ``ep``); the ``dp / ep`` ranks
    of its ``dp_rep`` group hold the same ones. Sharded over dp_rep (FSDP's 2-D path: the
    ep DTensor is its "model-parallel" dim, as torchtitan shards experts over
    ``dp_shard_mod_ep``), every rank keeps ``1 / dp`` of the experts' weights, gradients
    and AdamW state, gathers a layer's ``E / ep`` experts for its forward and backward
    like any block, and their gradient's reduction over dp_rep is FSDP's bucketed fp32
    reduce-scatter, overlapped as the blocks' are. The all-to-all's backward has summed the
    ep group's share already, so the reduce-scatter sums and divides by dp, not by dp_rep
    (a sum then a division: gloo has no pre-scaled sum). The experts run as one module call
    per dispatch (one grouped or batched call on all received rows:
    :func:`boostlr.parallel.expert_parallel.run_received`), so the unit gathers once per
    forward and reduce-scatters once per backward. Under
    ``ddp`` mode (``reshard`` false) they stay gathered from forward to backward, as the
    blocks do. At dp_rep 1 nothing is replicated: no unit (``reduce_expert_grads`` divides).
    """
    if comms.ep.size == 1 or comms.group("dp_rep").size == 1:
        return []
    units = []
    for layer in moe_layers(model):
        experts = layer.experts
        fully_shard(
            experts,
            mesh=comms.dim_mesh("dp_rep"),
            reshard_after_forward=reshard,
            mp_policy=policy,
        )
        assert isinstance(experts, FSDPModule)
        experts.set_gradient_divide_factor(float(comms.dp.size))
        experts.set_force_sum_reduction_for_comms(True)
        units.append(experts)
    return units


def fsdp_units_by_group(
    parts: list[TensorParallelModel], comms: MeshComms
) -> list[tuple[list[FSDPModule], GroupComm]]:
    """Every FSDP unit of ``parts`` with the group it runs on: the routed experts' units
    (:func:`shard_experts_over_dp`) on ``dp_rep``, every other unit on ``dp``."""
    units = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
    experts = {id(layer.experts) for part in parts for layer in moe_layers(part.model)}
    rest = [m for m in units if id(m) not in experts]
    over_rep = [m for m in units if id(m) in experts]
    out = [(rest, comms.dp)] if rest else []
    return out + ([(over_rep, comms.group("dp_rep"))] if over_rep else [])


def in_place_collectives(group: dist.ProcessGroup | None) -> bool:
    """Whether FSDP's gathers and reductions on ``group`` should run in place.

    gloo (CPU) implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a
    temporary the size of the whole buffer: with the largest unit (the embedding or the LM
    head) that is the largest transient of a rank. NCCL writes in place, so FSDP's own calls
    stay. Decided once per run, when the units are built.
    """
    return fsdp_in_place_collectives(dist.get_backend(group))


def set_fsdp_collectives(modules: list, comm: GroupComm, in_place: bool) -> None:
    """Give every FSDP unit in ``modules`` the recorded (and, if ``in_place``, copy-free)
    all-gather and reduce-scatter over ``comm``.

    In place, each unit also frees its flat gather buffer as its forward starts (a forward
    pre-hook registered after ``fully_shard``'s, so it runs after FSDP's copy-out).
    """
    for module in modules:
        assert isinstance(module, FSDPModule)
        gather = _RecordedAllGather(comm, in_place)
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(_RecordedReduceScatter(comm, in_place))
        previous = getattr(module, "_release_gathered_hook", None)
        if previous is not None:  # set again (e.g. to torch's calls): one hook at most
            previous.remove()
        module._release_gathered_hook = (
            module.register_forward_pre_hook(lambda _m, _args, g=gather: g.release_gathered())
            if in_place
            else None
        )
