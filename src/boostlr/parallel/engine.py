"""This rank's share of the model for any ``pp x dp x tp`` layout, behind one interface.

The training loop sees a :class:`ParallelModel`: a batch's forward + backward, the global
loss, clipping by the norm of the whole model, evaluation and the step's traffic. Building
it (mesh, stages, shards, FSDP, schedule) happens here and in the modules it calls, never in
the loop. One process without a process group runs the plain single-device model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from boostlr.config import RunConfig
from boostlr.models.moe import MoEMLP, moe_layers
from boostlr.parallel.build import build_stages
from boostlr.parallel.expert_parallel import (
    clip_grads_with_norm,
    reduce_expert_grads,
    total_grad_norm,
)
from boostlr.parallel.mesh import MeshComms, build_mesh, single_process_comms
from boostlr.parallel.pipeline import Pipeline, evaluate_pipeline
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.platform import to_device


class ParallelModel:
    """The stages this rank holds and how a batch runs through them."""

    def __init__(
        self,
        cfg: RunConfig,
        comms: MeshComms,
        stages: list[TensorParallelModel],
        device: torch.device,
    ):
        self.cfg, self.comms, self.stages, self.device = cfg, comms, stages, device
        self.accum = cfg.train.grad_accum
        self.pipeline = (
            Pipeline(cfg, stages, comms.pp, device, loss_scale=1 / self.accum)
            if comms.pp.size > 1
            else None
        )

    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        device: torch.device,
        mark_phase: Callable[[str], None] = lambda phase: None,
    ) -> ParallelModel:
        """Distributed when a default process group exists, else the single-device model.

        Every layout, one process included, builds on the meta device and materialises each
        parameter as a counter-based draw of (seed, name, index), so values never depend on layout.
        """
        if dist.is_initialized():
            comms = build_mesh(cfg.parallel, device)
        else:
            comms = single_process_comms()
        stages = build_stages(cfg, comms, device, comms.pp.rank, mark_phase)
        return cls(cfg, comms, stages, device)

    # ------------------------------------------------------------------ parameters

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Global (single-device) names of this rank's parameters."""
        return [(n, p) for part in self.stages for n, p in part.model.named_parameters()]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    @property
    def has_last_stage(self) -> bool:
        return any(part.model.last for part in self.stages)

    def train(self, mode: bool = True) -> None:
        for part in self.stages:
            part.train(mode)

    # ------------------------------------------------------------------ one batch

    def forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Loss of one ``batch_size`` micro-batch; gradients (scaled by 1/grad_accum) added.

        Returns this rank's detached mean loss (0 on a pipeline rank without the last stage).
        The training loader hands over batches already on the device; anything else is
        copied the device module's way (pinned and non-blocking on a GPU).
        """
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        if self.pipeline is not None:
            return self.pipeline.step(inputs, targets)
        loss = self.stages[0](inputs, targets)
        (loss / self.accum).backward()
        return loss.detach()

    def global_mean(self, local: Tensor) -> Tensor:
        """Mean over data-parallel ranks of a loss that lives on the last pipeline stage.

        A 0-d tensor on the device: reading it is a host sync, left to the log steps.
        """
        value = local.detach().float().reshape(1).clone()
        if not dist.is_initialized():
            return value.reshape(())
        if not self.has_last_stage:
            value.zero_()
        # Each (dp, tp) coordinate of the last stage holds a copy; the tp copies are equal.
        value /= self.comms.dp.size * self.comms.tp.size
        dist.all_reduce(value)
        return value.reshape(())

    def reduce_expert_gradients(self) -> None:
        """Make every routed-expert shard's gradient the dp mean, as FSDP makes the others'.

        The all-to-all's backward leaves each shard its ep group's sum; the replicas over
        ``dp_rep`` still differ. Call once per step, after the last micro-batch's backward
        and before :meth:`clip_gradients`; at ep 1 it issues no collective.
        """
        for part in self.stages:
            reduce_expert_grads(part.model, self.comms)

    def clip_gradients(self, max_norm: float) -> Tensor:
        """Clip by the L2 norm of the whole model's gradient (over tp, dp and pp).

        Returns the norm as a 0-d device tensor and never asks whether it is finite (a host
        sync): a non-finite norm makes non-finite gradients, which the loop's check on the
        next log step or save reports before anything is written.
        """
        params = [p for p in self.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        if grads:
            norm = total_grad_norm(grads)
        else:
            norm = torch.zeros((), device=self.device)
        if self.comms.pp.size > 1:  # each stage holds different parameters
            square = norm.float().pow(2).reshape(1)
            dist.all_reduce(square, group=self.comms.pp.group)
            norm = square.sqrt().reshape(())
        if max_norm > 0:
            clip_grads_with_norm(params, max_norm, norm)
        return norm

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(
        self, batches: list[tuple[Tensor, Tensor]], autocast: AbstractContextManager
    ) -> float:
        """Mean loss per window over this rank's ``batches`` and those of the other dp ranks.

        Every window has ``seq_len`` targets, so the mean over windows is the token mean;
        the result is the same on every rank.
        """
        self.train(False)
        # [sum of window losses, windows], on the device: one host read at the end.
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in batches:
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
            with autocast:
                if self.pipeline is not None:
                    loss = evaluate_pipeline(self.stages, self.cfg, self.comms.pp, inputs, targets)
                else:
                    loss = self.stages[0](inputs, targets)
            total[0] += loss.double() * len(inputs)
            total[1] += len(inputs)
        self.train(True)
        if self.comms.dp.size > 1:
            self._reshard()
            dist.all_reduce(total, group=self.comms.dp.group)
        return float(total[0] / total[1])

    def _reshard(self) -> None:
        """Put every FSDP unit back to its shards after forwards without a backward.

        Under ``dp_mode ddp`` (no reshard after forward) an evaluation would leave the units
        gathered: the module would then hold the gathered parameters, not the sharded ones
        the optimizer keys its state by, and a checkpoint saved next would miss that state.
        """
        for part in self.stages:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ------------------------------------------------------------------ metrics

    def step_metrics(self) -> dict[str, int]:
        """This rank's traffic in the step: ``comm_tp_*``, ``comm_dp_bytes``, ``comm_pp_bytes``
        and, at ep > 1 only (rows without experts keep their keys), ``comm_ep_bytes``."""
        ledger = self.comms.ledger
        row = {
            **ledger.step_metrics("comm_tp", group="tp"),
            "comm_dp_bytes": ledger.totals("dp")["bytes"],
            "comm_pp_bytes": ledger.totals("pp")["bytes"],
        }
        if self.comms.ep.size > 1:
            row["comm_ep_bytes"] = ledger.totals("ep")["bytes"]
        return row

    def moe_layers(self) -> list[MoEMLP]:
        """This rank's MoE layers, their balance loss's gradient scaled as the LM loss is.

        Each micro-batch's loss is backpropagated divided by ``grad_accum``; the balance loss,
        whose gradient the layer adds in the backward, takes the same factor, so a step's
        gradient is that of one batch of all its micro-batches.
        """
        layers = [layer for part in self.stages for layer in moe_layers(part.model)]
        # A pipeline splits each micro-batch again and scales each piece's loss by 1/pieces.
        pieces = self.cfg.parallel.pp_microbatches if self.pipeline is not None else 1
        for layer in layers:
            layer.aux_scale = 1 / (self.accum * pieces)
        return layers

    def moe_metrics(self, layers: Sequence[MoEMLP]) -> dict[str, float | int]:
        """The MoE keys of a step row (docs/metrics.md), the same on every rank.

        What ``layers`` recorded since :meth:`MoEMLP.start_stats` goes into one
        ``[n_layers, E + 2 | forwards, spread, held, aux, bias]`` table, each rank writing
        its own layers' rows (zeros for the others): summed over dp (the counts), then over
        pp, so every rank, a stage without an MoE layer too, enters collectives of one
        shape; then one host copy. Call it on log steps only, on every rank. Empty for a
        dense model.
        """
        m = self.cfg.model
        if not m.moe_experts:
            return {}
        width = m.moe_experts + 2
        counts = torch.zeros(m.n_layers, width, dtype=torch.float64, device=self.device)
        extra = torch.zeros(m.n_layers, 5, dtype=torch.float64, device=self.device)
        for layer in layers:
            taken = layer.take_stats()
            if taken is None:
                continue
            i, (values, forwards) = layer.layer_index, taken
            counts[i] = values
            extra[i, 0], extra[i, 1], extra[i, 2] = forwards, _bias_spread(layer), 1.0
            extra[i, 3] = float(layer.aux_coef != 0)
            extra[i, 4] = float(layer.router.balance == "bias")
        if self.comms.dp.size > 1:
            dist.all_reduce(counts, group=self.comms.dp.group)
        table = torch.cat([counts, extra], dim=1)
        if self.comms.pp.size > 1:
            dist.all_reduce(table, group=self.comms.pp.group)
        values = table.tolist()  # the one host read
        held = [i for i, r in enumerate(values) if r[width + 2]]  # the MoE blocks, in order
        rows = [values[i] for i in held]
        if not rows:
            return {}
        pieces = self.cfg.parallel.pp_microbatches if self.pipeline is not None else 1
        return moe_row(
            held,
            [r[:width] for r in rows],
            [round(r[width]) for r in rows],
            [r[width + 1] for r in rows],
            micro_batches=self.accum * pieces,
            dp=self.comms.dp.size,
            aux=any(r[width + 3] for r in rows),
            bias=any(r[width + 4] for r in rows),
        )


def _bias_spread(layer: MoEMLP) -> Tensor:
    """``max - min`` of the layer's balance bias (0 without one): equal on every rank."""
    bias = getattr(layer.router, "expert_bias", None)
    if bias is None:
        return torch.zeros((), device=layer.router.load.device)
    return (bias.max() - bias.min()).detach()


def moe_row(
    indices: list[int],
    stats: list[list[float]],
    forwards: list[int],
    spreads: list[float],
    micro_batches: int,
    dp: int,
    aux: bool,
    bias: bool,
) -> dict[str, float | int]:
    """The MoE keys from the dp-summed ``[load per expert | dropped | balance loss]`` of each
    layer (block ``indices``), recorded over ``forwards`` forwards per rank.

    Activation checkpointing's re-forwards double every sum alike: the load ratios do not
    move, and the dropped copies and the balance loss are rescaled to one forward per
    micro-batch.
    """
    row: dict[str, float | int] = {}
    loads, dropped, losses = [], 0.0, []
    for index, values, n in zip(indices, stats, forwards, strict=True):
        if n == 0:
            continue
        load = values[:-2]
        mean = sum(load) / len(load)
        loads.append(max(load) / mean if mean else 0.0)
        row[f"moe_load/{index}"] = loads[-1]
        dropped += values[-2] * micro_batches / n
        losses.append(values[-1] / (n * dp))
    if not loads:
        return {}
    row["moe_load_max_over_mean"] = max(loads)
    row["moe_dropped"] = round(dropped)
    if aux:
        row["moe_aux_loss"] = sum(losses) / len(losses)
    if bias:
        row["moe_bias_spread"] = max(spreads)
    return row
