"""The mixture-of-experts MLP of one block (docs/moe.md; design notes §9), on one device.

A router on the block's normed input picks ``moe_top_k`` of ``moe_experts`` routed experts per
token; their outputs are summed with the router's weights, plus the shared experts' (weight
1). Two dispatch forms:

- ``latent`` (cola, svd, lax): the experts share the outer factors ``A_g, A_u`` (d -> r) and
  ``B_d`` (r -> d). A token is routed as ``z = [σ(A_g x) | σ(A_u x)]`` (2r wide), expert ``e``
  returns ``u_e = σ(A_d^e h_e)`` (r wide) and, ``B_d`` being linear, one ``B_d`` maps the
  weighted sum: ``Σ w_k B_d u_k = B_d Σ w_k u_k``. It equals a MoE of whole CoLA MLPs whose
  outer factors are tied (tests/test_moe_model.py checks it).
- ``hidden``: each expert is a whole MLP of the arch and the d-wide token is routed.

Load balance: ``bias`` (DeepSeek-V3): sigmoid scores; a per-expert bias, a buffer and not a
parameter, shifts only which experts are selected and moves after each optimizer step
against the step's load (:func:`update_expert_biases`). ``aux``: softmax scores and a
sequence-level balance loss whose gradient is added in the backward (:class:`_AddAuxGrad`),
so no caller has to add it to the loss, pipeline stages included.

The layer is a chain of plain parts: the router (:mod:`boostlr.models.moe_router`) gives
a routing map (:mod:`boostlr.models.moe_routing`); a dispatch
(:mod:`boostlr.models.moe_dispatch`, or the one a runtime hands the layer: expert
parallelism's) runs the map's copies through the experts (:mod:`boostlr.models.moe_experts`)
and sums them per token. What an MoE model *is* (its blocks, dispatch forms, balances,
parameter names) is :mod:`boostlr.specs.moe`'s; its bookkeeping around a step (the balance
bias, the balance loss's scale, the metrics) is the
engine's step hook :mod:`boostlr.parallel.moe_steps`. Parallelism is applied from outside.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from boostlr.config import ModelConfig
from boostlr.config.validate_moe import dispatch_of
from boostlr.models.lowrank import LatentCrossing
from boostlr.models.moe_dispatch import (
    Dispatch,
    ExpertFn,
    dropless,
    expert_counts,
    with_capacity,
)
from boostlr.models.moe_experts import LatentExperts, WholeExperts, latent_sigma
from boostlr.models.moe_router import Router, TopKRouter
from boostlr.models.moe_routing import Routing
from boostlr.models.params import forward_dtype, local
from boostlr.specs.arch import arch_spec
from boostlr.specs.moe import balance_spec, capacity_of, is_moe_layer, is_saved_buffer

Latents = dict[str, torch.Tensor | None]

#: The :class:`MoEMLP`'s ``kind`` (:class:`~boostlr.models.mlp.BlockMLP`): the runtimes that
#: list it in their ``MLP_KINDS`` run it (the single-device block, under dp, ep and pp; BTP,
#: latent dispatch): :mod:`boostlr.parallel.strategies`.
MOE = "moe"


class SharedIn(nn.Module):
    """A shared outer in-factor ``σ(A x)`` (LaX: ``σ(LN_r(A x + G(z_prev)))``), d -> r."""

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | str | None = None):
        super().__init__()
        self.activation = latent_sigma(cfg)
        self.down = nn.Linear(cfg.dim, cfg.rank, bias=False, device=device)  # A: d -> r
        if arch_spec(cfg.arch).crossing:
            gate = cfg.lax_gate if layer > 0 else None
            self.cross = LatentCrossing(
                cfg.rank, gate, cfg.lax_gate_rank, cfg.norm_eps, device=device
            )

    def forward(
        self, x: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.latent(F.linear(x, local(self.down.weight)), z_prev)

    def latent(
        self, a: torch.Tensor, z_prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """σ (LaX: the crossing, then σ) of ``a = A x``: BTP computes ``a`` row-parallel."""
        if hasattr(self, "cross"):
            normed, z = self.cross(a, z_prev)
            return F.silu(normed), z
        return (F.silu(a) if self.activation else a), None


class _Out(nn.Module):
    """The shared outer out-factor ``B_d`` (r -> d), named ``down_proj.up`` as in CoLA."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        self.up = nn.Linear(cfg.rank, cfg.dim, bias=False, device=device)


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``y``; its backward gives the balance loss ``aux`` the gradient ``scale``.

    The loss then trains the router without any caller adding it to the LM loss, which
    under a pipeline lives on another stage. ``scale`` is what the trainer multiplies the LM
    loss by before its backward (1 / gradient-accumulation micro-batches).
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoEMLP(nn.Module):
    """The MoE MLP: ``forward(x, z_prev) -> (y, latents)``, as the dense MLP's.

    After a forward, ``aux_loss`` holds the balance loss (coefficient applied, detached; 0-d,
    balance ``aux`` only) and ``dropped`` the copies over capacity, or over expert
    parallelism's receive bound (0-d int64; ``None`` when dropless at ep 1),
    both device tensors for the metrics: reading them is the caller's host sync.
    ``aux_scale`` is the factor the trainer applies to the LM loss before its backward
    (1 / micro-batches per step); the balance loss's gradient is scaled by it.

    Under LaX the latents are those of the shared in-factors (``gate_proj``, ``up_proj``);
    ``down_proj`` has no in-factor of its own here, so its latent is ``None``: present, as
    whole-block checkpointing passes every crossing name through, and read by no block (the
    blocks after an MoE block are MoE blocks, whose ``B_d`` takes no crossing), so a
    pipeline stage boundary does not carry it (:func:`boostlr.models.shapes.crossing_latents`).
    """

    kind = MOE

    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | str | None = None):
        super().__init__()
        self.experts_n, self.capacity = cfg.moe_experts, cfg.moe_capacity
        self.aux_coef = cfg.moe_aux_coef if balance_spec(cfg.moe_balance).balance_loss else 0.0
        self.bias_rate = cfg.moe_bias_rate
        self.aux_scale = 1.0
        self.latent = dispatch_of(cfg).shared_outer
        self.router: Router = TopKRouter(cfg, device)
        if self.latent:
            self.gate_proj = SharedIn(cfg, layer, device)  # A_g
            self.up_proj = SharedIn(cfg, layer, device)  # A_u
            self.down_proj = _Out(cfg, device)  # B_d
            self.experts: nn.Module = LatentExperts(cfg, cfg.moe_experts, device)
            shared = LatentExperts(cfg, cfg.moe_shared, device) if cfg.moe_shared else None
        else:
            self.experts = WholeExperts(cfg, cfg.moe_experts, device)
            shared = WholeExperts(cfg, cfg.moe_shared, device) if cfg.moe_shared else None
        if shared is not None:
            self.shared = shared
        self.aux_loss: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.layer_index = layer
        self.stats: torch.Tensor | None = None  # a log step's counts: start_stats, take_stats
        self.stat_forwards = 0
        #: How routed copies reach experts held elsewhere (``None``: all are here); set with
        #: the experts' sharding (:func:`boostlr.parallel.expert_parallel.shard_experts`).
        self.dispatch: Dispatch | None = None

    def forward(self, x: torch.Tensor, z_prev: Latents | None) -> tuple[torch.Tensor, Latents]:
        lead = x.shape[:-1]
        tokens = x.reshape(-1, x.shape[-1])
        route = self.router(tokens)
        z: Latents = {}
        if self.latent:
            # On x's own shape: LaX's latents leave the block as tensors of their own, not
            # views (FSDP warns of a unit output that is a view: an in-place op would lose
            # its backward hook).
            zg, z["gate_proj"] = self.gate_proj(x, _get(z_prev, "gate_proj"))
            zu, z["up_proj"] = self.up_proj(x, _get(z_prev, "up_proj"))
            payload = torch.cat([zg, zu], dim=-1).reshape(tokens.shape[0], -1)
            z["down_proj"] = None
        else:
            # In the compute dtype (bf16 under bf16): what the experts' GEMMs read anyway, and
            # half the bytes an all-to-all sends at ep > 1.
            payload = tokens.to(forward_dtype(tokens))
        out = self.routed(payload, route)
        if hasattr(self, "shared"):
            out = out + self.shared(payload, None).sum(0)
        if self.latent:
            out = F.linear(out, local(self.down_proj.up.weight))
        return self.account(out.reshape(*lead, -1), route, lead), z

    def account(self, y: torch.Tensor, route: Routing, lead: torch.Size) -> torch.Tensor:
        """After a forward of ``route`` (every token of the micro-batch, shaped ``lead``):
        count the load and the statistics, and attach the balance loss's gradient to ``y``."""
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.router.load += expert_counts(route.expert, self.experts_n)
        if self.aux_coef:
            aux = self.aux_coef * balance_loss(route, lead, self.experts_n)
            self.aux_loss = aux.detach()
            if aux.requires_grad:
                y = _AddAuxGrad.apply(y, aux, self.aux_scale)
        if self.stats is not None and self.training and torch.is_grad_enabled():
            self._record(route)
        return y

    def start_stats(self) -> None:
        """Record the training forwards from now on (a step that logs): device counters only.

        ``stats`` is ``[load per expert (E) | dropped copies | balance loss]``, summed over
        the forwards; quiet steps record nothing, so they pay no device work for metrics.
        """
        self.stats = torch.zeros(
            self.experts_n + 2, dtype=torch.float64, device=self.router.load.device
        )
        self.stat_forwards = 0

    def take_stats(self) -> tuple[torch.Tensor, int] | None:
        """The recorded ``(stats, forwards)`` (still on the device), and stop recording.

        ``forwards`` counts the recorded forwards, re-forwards of activation checkpointing
        included (they route the same tokens again, so every sum doubles alike).
        """
        taken = None if self.stats is None else (self.stats, self.stat_forwards)
        self.stats, self.stat_forwards = None, 0
        return taken

    @torch.no_grad()
    def _record(self, route: Routing) -> None:
        """Add one forward's routed copies per expert, dropped copies and balance loss."""
        assert self.stats is not None
        self.stats[: self.experts_n] += expert_counts(route.expert, self.experts_n)
        if self.dropped is not None:
            self.stats[-2] += self.dropped
        if self.aux_coef and self.aux_loss is not None:
            self.stats[-1] += self.aux_loss
        self.stat_forwards += 1

    def routed(
        self, payload: torch.Tensor, route: Routing, fn: ExpertFn | None = None
    ) -> torch.Tensor:
        """The routed experts' weighted sum per token; ``fn`` stands in for the experts (a
        runtime that wraps their weights: BTP sums their gradients over TP)."""
        fn = self.experts if fn is None else fn
        if self.dispatch is not None:
            out, self.dropped = self.dispatch(payload, route, self.experts_n, fn)
            return out
        if not self.capacity:
            return dropless(payload, route, self.experts_n, fn)
        k = route.copies // max(1, route.tokens)  # copies per token (top-k: k)
        cap = capacity_of(route.tokens, k, self.experts_n, self.capacity)
        out, self.dropped = with_capacity(payload, route, self.experts_n, cap, fn)
        return out


def balance_loss(route: Routing, lead: torch.Size, experts: int) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V3's): the mean over sequences of
    ``Σ_i f_i P_i``, with ``f_i = E / (k s) · #(tokens choosing i)`` and ``P_i`` the mean
    normalised score of expert ``i`` over the sequence's ``s`` tokens. 1 when balanced."""
    seq = lead[-1] if len(lead) else 1
    k = route.copies / max(1, route.tokens)  # copies per token (top-k: k)
    chosen = torch.zeros_like(route.scores).index_put_(
        (route.token, route.expert), route.scores.new_ones(())
    )
    f = chosen.view(-1, seq, experts).sum(1) * (experts / (k * seq))
    p = route.scores.view(-1, seq, experts).mean(1)
    return (f * p).sum(-1).mean()


def make_moe_mlp(
    cfg: ModelConfig, layer: int, device: torch.device | str | None = None
) -> MoEMLP | None:
    """Block ``layer``'s MoE MLP, or ``None`` where the block keeps the dense MLP
    (``moe_experts = 0``, or one of the first ``moe_dense_layers`` blocks)."""
    return MoEMLP(cfg, layer, device) if is_moe_layer(cfg, layer) else None


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """Every MoE MLP in ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


@torch.no_grad()
def update_expert_biases(layers: Sequence[MoEMLP], group: dist.ProcessGroup | None = None) -> None:
    """Balance ``bias``: after an optimizer step, move each expert's bias by ``moe_bias_rate``
    towards the mean load (up if under it, down if over), and restart the counts.

    ``group`` sums the loads over the ranks that see different tokens (data parallel) first;
    the sign is then decided in integers, so every rank moves every bias identically and the
    buffers stay equal without being broadcast. A forward run twice (activation
    recomputation) doubles all counts alike, which leaves every sign unchanged.
    """
    biased = [layer for layer in layers if layer.router.balance.selection_bias]
    if biased:
        # One collective for all layers: [layers, E] int64, the same shape on every rank of
        # the group (its ranks hold the same blocks).
        loads = torch.stack([layer.router.load for layer in biased])
        if group is not None:
            dist.all_reduce(loads, group=group)
        for layer, load in zip(biased, loads, strict=True):
            signs = torch.sign(load.sum() - load * load.numel())  # mean - load, times E
            bias = layer.router.expert_bias
            bias += layer.bias_rate * signs.to(bias.dtype)
    for layer in layers:
        layer.router.load.zero_()


def zero_meta_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Give every buffer still on the meta device its starting value on ``device``: zeros.

    A model built on the meta device gets its parameters elsewhere (drawn, or loaded); its
    only buffers are the MoE routers' balance bias and load counts, both zero at the start
    (a checkpoint then restores the bias). Under data parallelism they are whole on every
    rank: FSDP leaves buffers alone.
    """
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            setattr(module, attr, torch.zeros(buf.shape, dtype=buf.dtype, device=device))


def checkpointed_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds beside the parameters, by global name: each MoE
    router's balance bias (none for a dense model, whose checkpoints keep their keys)."""
    return [(n, b) for n, b in model.named_buffers() if is_saved_buffer(n)]


def _get(z: Latents | None, name: str) -> torch.Tensor | None:
    """The previous block's latent of linear ``name`` (the block input's shape, r wide)."""
    return None if z is None else z.get(name)
