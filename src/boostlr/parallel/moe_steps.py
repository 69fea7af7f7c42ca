"""The MoE layers' bookkeeping around a training step, behind the engine's step hooks.

:class:`MoESteps` is the :class:`~boostlr.parallel.step_hooks.StepHook` of a rank's MoE
layers: it scales their balance loss's gradient as the LM loss is scaled, starts their
routing statistics on a step that logs, moves the balance bias after the optimizer step
(:func:`boostlr.models.moe.update_expert_biases`) and turns the statistics into a step
row's MoE keys (docs/moe.md, "Metrics"). The step loop knows none of this: it calls the
engine's generic hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from boostlr.config import RunConfig
from boostlr.models.moe import MoEMLP, moe_layers, update_expert_biases
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.tensor_parallel import TensorParallelModel

#: The per-layer columns beside the ``[load per expert | dropped | balance loss]`` stats.
FORWARDS, SPREAD, HELD, LOSS, BIAS = range(5)


class MoESteps:
    """This rank's MoE layers' step hooks (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        comms: MeshComms,
        layers: list[MoEMLP],
        device: torch.device,
        micro_batches: int,
    ):
        self.cfg, self.comms, self.layers, self.device = cfg, comms, layers, device
        self.micro_batches = micro_batches
        # Each micro-batch (or pipeline piece) backpropagates its loss divided by their
        # number; the balance loss, whose gradient the layer adds in the backward, takes the
        # same factor, so a step's gradient is that of one batch of all its micro-batches.
        for layer in layers:
            layer.aux_scale = 1 / micro_batches

    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        comms: MeshComms,
        stages: list[TensorParallelModel],
        device: torch.device,
        micro_batches: int,
    ) -> MoESteps | None:
        """The hooks of an MoE model (``None`` for a dense one, which keeps its rows' keys)."""
        if not cfg.model.moe_experts:
            return None
        layers = [layer for part in stages for layer in moe_layers(part.model)]
        return cls(cfg, comms, layers, device, micro_batches)

    def begin_step(self, logs: bool) -> None:
        """Only a step that logs records its routing (quiet steps do no work for metrics)."""
        if logs:
            for layer in self.layers:
                layer.start_stats()

    def after_optimizer_step(self) -> None:
        """The balance bias moved by the step's loads, summed over dp: every rank moves
        every bias alike (one all-reduce of ``[MoE layers, E]`` integers)."""
        if self.layers:
            dp = self.comms.dp.group if self.comms.dp.size > 1 else None
            update_expert_biases(self.layers, group=dp)

    def log_metrics(self) -> dict[str, float | int]:
        """The MoE keys of a step row (docs/metrics.md), the same on every rank.

        What the layers recorded since :meth:`begin_step` goes into one
        ``[n_layers, E + 2 | forwards, spread, held, aux, bias]`` table, each rank writing
        its own layers' rows (zeros for the others): summed over dp (the counts; the dropped
        copies over tp too at ep x tp), then over pp, so every rank, a stage without an MoE
        layer too, enters collectives of one shape; then one host copy. Call it on log steps
        only, on every rank.
        """
        m = self.cfg.model
        width = m.moe_experts + 2
        counts = torch.zeros(m.n_layers, width, dtype=torch.float64, device=self.device)
        extra = torch.zeros(m.n_layers, 5, dtype=torch.float64, device=self.device)
        for layer in self.layers:
            taken = layer.take_stats()
            if taken is None:
                continue
            i, (values, forwards) = layer.layer_index, taken
            counts[i] = values
            extra[i, FORWARDS], extra[i, SPREAD], extra[i, HELD] = forwards, _spread(layer), 1.0
            extra[i, LOSS] = float(layer.aux_coef != 0)
            extra[i, BIAS] = float(layer.router.balance.selection_bias)
        if self.comms.dp.size > 1:
            dist.all_reduce(counts, group=self.comms.dp.group)
        if self.comms.tp.size > 1 and self.comms.ep.size > 1:
            # Under BTP each TP rank dispatches its own share of the tokens, so each drops
            # its own copies past the receive bound; the loads are the whole micro-batch's.
            dropped = counts[:, m.moe_experts].contiguous()
            dist.all_reduce(dropped, group=self.comms.tp.group)
            counts[:, m.moe_experts] = dropped
        table = torch.cat([counts, extra], dim=1)
        if self.comms.pp.size > 1:
            dist.all_reduce(table, group=self.comms.pp.group)
        values = table.tolist()  # the one host read
        held = [i for i, r in enumerate(values) if r[width + HELD]]  # the MoE blocks, in order
        rows = [values[i] for i in held]
        if not rows:
            return {}
        return moe_row(
            held,
            [r[:width] for r in rows],
            [round(r[width + FORWARDS]) for r in rows],
            [r[width + SPREAD] for r in rows],
            micro_batches=self.micro_batches,
            dp=self.comms.dp.size,
            aux=any(r[width + LOSS] for r in rows),
            bias=any(r[width + BIAS] for r in rows),
        )


def _spread(layer: MoEMLP) -> Tensor:
    """``max - min`` of the layer's balance bias (0 without one): equal on every rank."""
    if not layer.router.balance.selection_bias:
        return torch.zeros((), device=layer.router.load.device)
    bias = layer.router.expert_bias
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
