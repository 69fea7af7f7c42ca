"""This rank's share of the model for any ``pp x dp x tp`` layout, behind one interface.

The training loop sees a :class:`ParallelModel`: a batch's forward + backward, the global
loss, clipping by the norm of the whole model, evaluation and the step's traffic. Building
it (mesh, stages, shards, FSDP, schedule) happens here and in the modules it calls, never in
the loop. One process without a process group runs the plain single-device model.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from boostlr.config import RunConfig
from boostlr.parallel.btp_moe import sum_moe_grads_over_tp
from boostlr.parallel.build import build_stages
from boostlr.parallel.expert_parallel import (
    clip_grads_with_norm,
    experts_flat_group,
    reduce_expert_grads,
    total_grad_norm,
)
from boostlr.parallel.mesh import MeshComms, build_mesh, single_process_comms
from boostlr.parallel.pipeline import Pipeline, evaluate_pipeline
from boostlr.parallel.step_hooks import step_hooks
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
        # A pipeline splits each micro-batch again and scales each piece's loss by 1/pieces.
        pieces = cfg.parallel.pp_microbatches if self.pipeline is not None else 1
        self.hooks = step_hooks(cfg, comms, stages, device, self.accum * pieces)

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

    # ------------------------------------------------------------------ one step

    def begin_step(self, logs: bool) -> None:
        """Before a step's first forward: the model's parts learn whether it logs (what a
        row reads is recorded on those steps only)."""
        for hook in self.hooks:
            hook.begin_step(logs)

    def after_optimizer_step(self) -> None:
        """After ``optimizer.step()``: the model's state that follows the step, not the
        gradient (an MoE router's balance bias), moved alike on every rank."""
        for hook in self.hooks:
            hook.after_optimizer_step()

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
        """Finish the MoE gradients the backward leaves partial, once per step.

        Under BTP at tp > 1 each TP rank's router and expert gradients cover its own share
        of the tokens: one fp32 all-reduce over tp sums them
        (:func:`~boostlr.parallel.btp_moe.sum_moe_grads_over_tp`). At ep > 1 the all-to-all's
        backward leaves each expert shard its ep group's sum, made the dp mean here (or by
        FSDP over ``dp_rep``). Call once per step, after the last micro-batch's backward
        and before :meth:`clip_gradients`; at tp 1 and ep 1 it issues no collective.
        """
        for part in self.stages:
            sum_moe_grads_over_tp(part.model, self.comms.tp)
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
            norm = total_grad_norm(grads, experts_flat_group(self.comms))
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

    def log_metrics(self) -> dict[str, float | int]:
        """The model's own keys of a step row (an MoE model's routing: docs/moe.md), the
        same on every rank. Call it on log steps only, on every rank (collectives inside)."""
        row: dict[str, float | int] = {}
        for hook in self.hooks:
            row.update(hook.log_metrics())
        return row
