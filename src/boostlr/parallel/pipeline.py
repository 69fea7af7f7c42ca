"""Pipeline parallelism with ``torch.distributed.pipelining`` (docs/design.md §4).

Layers are split evenly into stages: the embedding on the first, final norm + head on the
last, whose forward ends in the loss itself (the fused head loss, :mod:`boostlr.parallel.head_loss`,
under ``train.fused_loss``): no stage outputs logits and the schedule keeps no outputs. A stage
boundary carries the residual (BTP: this rank's ``[mb, s, d/t]`` slice; Megatron/vanilla:
the replicated ``[mb, s, d]``) plus, for LaX, the latents the next block reads
(:func:`~boostlr.models.shapes.crossing_latents`: seven, or six into an MoE block, whose
``B_d`` takes no crossing), each in the dtype
:func:`~boostlr.parallel.tensor_parallel.boundary_dtypes` declares: the stage casts its
outputs to it, and the receive buffers here are allocated in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from boostlr._torch_internals import stage_backward, wrapped_p2p_waits
from boostlr.config import RunConfig
from boostlr.models.placement import stage_ids, stage_layers
from boostlr.models.shapes import crossing_latents
from boostlr.parallel.collectives import GroupComm
from boostlr.parallel.context import compute_dtype
from boostlr.parallel.tensor_parallel import TensorParallelModel, boundary_dtypes
from boostlr.specs.schedule import schedule_spec
from boostlr.specs.strategy import spec_or_none

META = torch.device("meta")


def boundary_shapes(cfg: RunConfig, micro: int, tp: int, layer: int) -> list[torch.Size]:
    """Shapes of the tensors one stage hands to the next, whose first block is ``layer``,
    for one pipeline micro-batch: the residual, then the latents that block reads."""
    m, s = cfg.model, cfg.data.seq_len
    spec = spec_or_none(cfg.parallel.strategy_for(m.arch))
    d = spec.residual_width(m.dim, tp) if spec else m.dim
    latent = (micro, s, m.rank)
    return [torch.Size((micro, s, d))] + [torch.Size(latent) for _ in crossing_latents(m, layer)]


def boundary_buffers(
    cfg: RunConfig,
    micro: int,
    tp: int,
    layer: int,
    device: torch.device,
    requires_grad: bool = False,
) -> tuple[Tensor, ...]:
    """Zeroed tensors shaped and typed as what crosses the stage boundary into block
    ``layer`` (the declaration of :func:`boundary_shapes` and
    :func:`~boostlr.parallel.tensor_parallel.boundary_dtypes`)."""
    dtypes = boundary_dtypes(cfg.model, compute_dtype(cfg.train.dtype), layer)
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)
        for shape, dtype in zip(boundary_shapes(cfg, micro, tp, layer), dtypes, strict=True)
    )


def first_layer(cfg: RunConfig, stage: int) -> int:
    """The first block of pipeline stage ``stage`` (what its boundary carries depends on it)."""
    return stage_layers(cfg.model.n_layers, cfg.parallel.num_stages, stage).start


class _RecordGradSend(torch.autograd.Function):
    """Identity; records the input gradient the stage sends back to the previous stage."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm) -> Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ctx.comm.ledger.record(
            "send", ctx.comm.name, "bwd", grad.numel() * grad.element_size(), grad.numel(), "grad"
        )
        return grad, None


def record_sends(part: TensorParallelModel, comm: GroupComm) -> None:
    """Record what the stage hands to the point-to-point layer (forward outputs, input grads).

    Forward hooks on the stage module: the p2p sends themselves happen inside torch.
    """

    def pre(module, args):
        if part.model.first:
            return None
        return tuple(_RecordGradSend.apply(a, comm) for a in args)

    def post(module, args, out):
        if part.model.last or not torch.is_grad_enabled():
            return None
        for t in out if isinstance(out, tuple) else (out,):
            comm.ledger.record(
                "send", comm.name, "fwd", t.numel() * t.element_size(), t.numel(), "act"
            )
        return None

    part.register_forward_pre_hook(pre)
    part.register_forward_hook(post)


@contextmanager
def timed_p2p_waits(comm: GroupComm, device: torch.device) -> Iterator[None]:
    """Time every point-to-point wait of the schedules into the ledger, as group ``pp``.

    torch's schedules issue sends/receives asynchronously and block in one helper
    (:func:`~boostlr._torch_internals.wrapped_p2p_waits`); it is wrapped with a timed one for
    the duration of a step (waiting for a receive includes waiting for the neighbouring
    stage: the bubble).
    """

    def timing(inner: Callable[[list[dist.Work]], None]) -> Callable[[list[dist.Work]], None]:
        def timed_wait(work: list[dist.Work]) -> None:
            with (
                torch.profiler.record_function("pp.p2p_wait"),
                comm.ledger.timed(comm.name, device),
            ):
                inner(work)

        return timed_wait

    with wrapped_p2p_waits(timing):
        yield


class ShardedBackwardStage(PipelineStage):
    """A stage whose FSDP parameters are resharded after every micro-batch's backward.

    torch's stages keep an FSDP module gathered, with unreduced full-size gradients, from the
    first micro-batch's backward until the schedule's final gradient reduction: the whole
    stage twice over, unsharded. Here each micro-batch's backward reduce-scatters its
    gradients (FSDP accumulates them into the sharded ``.grad``) and frees the gathered
    parameters, as FSDP does without a pipeline. The sum, and so every gradient, is the
    same; the price is one reduce-scatter (and one re-gather) per micro-batch. The method
    overridden is torch's private per-micro-batch backward
    (``_torch_internals.STAGE_BACKWARD_METHOD``, pinned by its canary).
    """

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


class Pipeline:
    """The schedule over this rank's stages; one :meth:`step` runs a batch's fwd + bwd."""

    def __init__(
        self,
        cfg: RunConfig,
        stages: list[TensorParallelModel],
        pp: GroupComm,
        device: torch.device,
        loss_scale: float,
    ):
        p = cfg.parallel
        self.parts, self.pp, self.ids = stages, pp, stage_ids(p, pp.rank)
        self.num_stages = p.num_stages
        self.micro = cfg.train.batch_size // p.pp_microbatches
        self.cfg, self.tp = cfg, stages[0].ctx.comm.size
        self.seq_len = cfg.data.seq_len
        self.loss_scale = loss_scale
        self.losses: list[Tensor] = []
        pipeline_stages = []
        # ddp mode keeps parameters gathered from forward to backward by design, so its
        # stages keep torch's single reduction after the last micro-batch.
        stage_class = ShardedBackwardStage if p.data_parallel_mode == "fsdp" else PipelineStage
        for part, sid in zip(stages, self.ids, strict=True):
            record_sends(part, pp)
            pipeline_stages.append(
                stage_class(
                    part,
                    sid,
                    self.num_stages,
                    device,
                    input_args=self._example_inputs(sid),
                    output_args=self._example_outputs(sid),
                    group=pp.group,
                )
            )
        spec = schedule_spec(p.pp_schedule)
        schedule_class = getattr(pipelining, spec.torch_class)
        # A multi-stage schedule takes the rank's list of stages, a single-stage one its stage.
        if spec.multi_stage:
            held: PipelineStage | list[PipelineStage] = pipeline_stages
        else:
            (held,) = pipeline_stages
        self.schedule = schedule_class(
            held, p.pp_microbatches, loss_fn=self._loss_fn(), scale_grads=False
        )
        self.microbatches = p.pp_microbatches
        self.has_last = any(part.model.last for part in stages)

    # A stage's example inputs and outputs are meta tensors: torch reads only their shapes,
    # dtypes and strides (its receive buffers are allocated on the stage's device), but
    # torch 2.11 and 2.12 keep the example tensors themselves for the stage's lifetime
    # (``inputs_meta``, ``_outputs_meta``): real ones would hold a micro-batch's boundary
    # activations (the stage's input and output) through every step.
    def _example_inputs(self, sid: int) -> tuple[Tensor, ...]:
        if sid == 0:
            return (torch.zeros(self.micro, self.seq_len, dtype=torch.long, device=META),)
        # Received activations need gradients: the stage sends their grads back.
        layer = first_layer(self.cfg, sid)
        return boundary_buffers(self.cfg, self.micro, self.tp, layer, META, requires_grad=True)

    def _example_outputs(self, sid: int) -> tuple[Tensor, ...]:
        if sid < self.num_stages - 1:  # requires_grad: the next stage sends their grads
            layer = first_layer(self.cfg, sid + 1)
            return boundary_buffers(self.cfg, self.micro, self.tp, layer, META, requires_grad=True)
        # The last stage's forward ends in its micro-batch's mean loss (it stays on the rank:
        # the schedule's loss function takes it, nothing receives it).
        return (torch.zeros((), dtype=torch.float32, device=META),)

    def _loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The schedule's loss: the last stage's output already is the micro-batch's loss.

        The stage computed it in its forward from the targets it was handed as a keyword
        argument (:meth:`step`), so the head's logits never leave it: fused, one buffer in
        the compute dtype, instead of ``[T, V/t]`` fp32 logits handed to the schedule.
        """

        def loss_fn(loss: Tensor, _targets: Tensor) -> Tensor:
            self.losses.append(loss.detach())
            return loss * self.loss_scale / self.microbatches

        return loss_fn

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Forward + backward of one batch; the mean loss on the last stage, else 0.

        ``targets`` reach the stages as a keyword argument, cut into micro-batches as the
        inputs are (every stage gets them; only the last reads them). The schedule keeps no
        outputs (``return_outputs=False``): by default it would hold every micro-batch's
        last-stage output until the step ends.
        """
        self.losses = []
        with timed_p2p_waits(self.pp, inputs.device):
            self.schedule.step(inputs, target=targets, targets=targets, return_outputs=False)
        if not self.losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack(self.losses).mean()


def evaluate_pipeline(
    stages: list[TensorParallelModel],
    cfg: RunConfig,
    pp: GroupComm,
    inputs: Tensor,
    targets: Tensor,
) -> Tensor:
    """Forward-only pass through every stage in order; the mean loss on every pp rank.

    Plain point-to-point sends over the pp group (no schedule: no backward to overlap).
    """
    by_id = dict(zip(stage_ids(cfg.parallel, pp.rank), stages, strict=True))
    num_stages = cfg.parallel.num_stages
    tp = stages[0].ctx.comm.size
    out: tuple[Tensor, ...] = ()
    loss = torch.zeros((), device=inputs.device)
    for sid in range(num_stages):
        if sid not in by_id:
            continue
        part = by_id[sid]
        if sid == 0:
            args: tuple[Tensor, ...] = (inputs,)
        elif sid - 1 in by_id:
            args = out
        else:
            layer = first_layer(cfg, sid)
            args = boundary_buffers(cfg, inputs.shape[0], tp, layer, inputs.device)
            for t in args:
                dist.recv(t, group_src=(sid - 1) % pp.size, group=pp.group)
        if sid == num_stages - 1:  # the last stage's forward ends in the loss
            loss = part(*args, targets=targets).float()
        else:
            result = part(*args)
            out = result if isinstance(result, tuple) else (result,)
            if sid + 1 not in by_id:
                for t in out:  # already as declared (TensorParallelModel.forward)
                    dist.send(t, group_dst=(sid + 1) % pp.size, group=pp.group)
    last_rank = (num_stages - 1) % pp.size
    loss = loss.reshape(1).contiguous()
    dist.broadcast(loss, group_src=last_rank, group=pp.group)
    return loss.reshape(())
