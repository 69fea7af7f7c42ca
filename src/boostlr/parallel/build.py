"""Build this rank's part of the model without ever holding the whole of it (docs/design.md §4).

Order (torchtitan's): split into pipeline stages -> build each stage on the meta device ->
materialise only this rank's tensor-parallel shards, each drawn alone on the rank's device
from its parameter's counter-based generator (:mod:`boostlr.models.init`; no full parameter
is ever drawn) and wrapped as a DTensor on the ``tp`` mesh dim (global shape + split dim)
-> data parallel (FSDP2) over ``dp``. An untied embedding and LM head are the exception
under data parallelism: their rows are split over dp as well (DTensors on the ``(dp, tp)``
mesh, :mod:`boostlr.parallel.vocab`) and FSDP leaves them alone. The result is a list of
:class:`TensorParallelModel` stages (more than one under the interleaved schedule).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from boostlr.config import RunConfig, vocab_over_dp
from boostlr.models.init import initial_value
from boostlr.models.llama import LlamaModel
from boostlr.models.moe import zero_meta_buffers
from boostlr.models.placement import VOCAB_PARAMS, chunk_range, stage_ids, stage_layers
from boostlr.parallel.context import TPContext
from boostlr.parallel.data_parallel import apply_data_parallel
from boostlr.parallel.expert_parallel import (
    as_expert_dtensor,
    expert_rows,
    use_expert_parallel,
)
from boostlr.parallel.mesh import MeshComms
from boostlr.parallel.sharding import ShardSpec, shard_box
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.platform import platform_for
from boostlr.specs.moe import is_routed_expert


def build_stages(
    cfg: RunConfig,
    comms: MeshComms,
    device: torch.device,
    pp_rank: int,
    mark_phase: Callable[[str], None] = lambda phase: None,
    draw: bool = True,
) -> list[TensorParallelModel]:
    """This rank's pipeline stages, sharded, initialised and data-parallel-wrapped.

    ``draw=False`` leaves the parameters uninitialised (for a trace on fake tensors).

    ``mark_phase("materialise")`` and ``mark_phase("FSDP wrap")`` close those phases for a
    memory report. Each stage's ``build_s`` is the seconds this rank spent building all of
    them (the first metrics row reports it per rank; on a GPU the draws end with host reads,
    so the time is the device's too).
    """
    started = time.perf_counter()
    p = cfg.parallel
    vocab_dp = comms.dp if splits_vocab_over_dp(cfg, comms) else None
    ctx = TPContext.from_config(comms.tp, cfg, vocab_dp=vocab_dp)
    stages = []
    for stage in stage_ids(p, pp_rank):
        layers = stage_layers(cfg.model.n_layers, p.num_stages, stage)
        meta = LlamaModel(
            cfg.model,
            device="meta",
            layers=layers,
            first=stage == 0,
            last=stage == p.num_stages - 1,
        )
        part = TensorParallelModel(meta, p.strategy_for(cfg.model.arch), ctx)
        materialize(part, cfg.train.seed, comms, device, draw, p.ep_receive_factor)
        stages.append(part)
    mark_phase("materialise")
    if comms.dp.size > 1:
        for part in stages:
            apply_data_parallel(part, comms, p.data_parallel_mode, cfg.train.dtype)
        mark_phase("FSDP wrap")
    for part in stages:
        part.build_s = time.perf_counter() - started
    return stages


def splits_vocab_over_dp(cfg: RunConfig, comms: MeshComms) -> bool:
    """Whether the embedding's and the head's rows are split over dp instead of FSDP-sharded.

    FSDP would gather each of them whole (``V x d / tp``, a model's largest units) in every
    forward and backward and hold their full gradient and its reduction buffer at once; split
    over dp they are never gathered. A tied table serves both the lookup (split along d under
    BTP) and the head, so it stays with FSDP; ``parallel.vocab_dp`` false (or ``auto``
    resolved to false: :func:`~boostlr.config.validate.vocab_dp_rule`) keeps them with FSDP
    too (as units of their own).
    """
    return comms.dp.size > 1 and vocab_over_dp(cfg) and not cfg.model.tie_embeddings


def materialize(
    part: TensorParallelModel,
    seed: int,
    comms: MeshComms,
    device: torch.device,
    draw: bool = True,
    receive_factor: float = 0.0,
) -> None:
    """Replace every meta parameter by this rank's shard of its seeded initial value.

    Each shard is drawn by itself on ``device``: the rank never holds (or pays for) the
    rest of a parameter. A parameter shared by several modules (tied embeddings) is
    materialised once and put back everywhere.
    """
    tp, rank = comms.tp.size, comms.tp.rank
    # At tp 1 a parameter is whole: a plain tensor, not a DTensor on a one-rank dim.
    tp_mesh = comms.tp_mesh if tp > 1 else None
    model = part.model
    chunk = platform_for(device).draw_chunk_counters
    replaced: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in replaced:
            spec, shape = part.specs[name], param.shape
            if name in VOCAB_PARAMS and part.ctx.vocab_dp_size > 1:
                value = _vocab_dtensor(name, shape, seed, spec, part, comms, device, draw)
            elif comms.ep.size > 1 and is_routed_expert(name):
                box = [expert_rows(shape[0], comms.ep), *((0, n) for n in shape[1:])]
                shard = initial_value(part.cfg, name, shape, seed, box, device, draw, chunk)
                value = as_expert_dtensor(shard, comms, shape)
            else:
                box = shard_box(shape, spec, rank, tp)
                shard = initial_value(part.cfg, name, shape, seed, box, device, draw, chunk)
                value = shard if tp_mesh is None else _as_dtensor(shard, spec, tp_mesh, shape)
            replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
        path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(path) if path else model, attr, replaced[id(param)])
    zero_meta_buffers(model, device)  # the MoE router's, all zero at the start
    if comms.ep.size > 1:
        use_expert_parallel(model, comms.ep, receive_factor)


def _vocab_dtensor(
    name: str,
    shape: torch.Size,
    seed: int,
    spec: ShardSpec,
    part: TensorParallelModel,
    comms: MeshComms,
    device: torch.device,
    draw: bool = True,
) -> DTensor:
    """This rank's rows of a vocabulary table split over dp (then over tp along ``spec``; at
    tp 1 on the ``dp`` mesh alone, where FSDP's units are, so a norm sees one mesh).

    Rows split over tp (``spec.dim == 0``): ``(Shard(0), Shard(0))`` on ``(dp, tp)``, the
    nested chunks of :func:`boostlr.parallel.vocab.vocab_split`; columns split over tp
    (BTP's embedding): ``(Shard(0), Shard(1))``; whole over tp: ``(Shard(0), Replicate())``.
    """
    split = part.ctx.vocab_split(rows_over_tp=spec.dim == 0)
    cols = (0, shape[1])
    if spec.dim == 1:
        cols = chunk_range(shape[1], comms.tp.rank, comms.tp.size)
    box = [(split.start, split.end), cols]
    shard = initial_value(
        part.cfg, name, shape, seed, box, device, draw, platform_for(device).draw_chunk_counters
    )
    stride = torch.empty(shape, device="meta").stride()
    if comms.tp.size == 1:  # on dp alone, as FSDP's units at tp 1: one mesh, one norm
        return DTensor.from_local(
            shard, comms.mesh["dp"], [Shard(0)], run_check=False, shape=shape, stride=stride
        )
    tp_placement = Replicate() if spec.dim is None else Shard(spec.dim)
    mesh = comms.mesh["dp", "tp"]
    return DTensor.from_local(
        shard, mesh, [Shard(0), tp_placement], run_check=False, shape=shape, stride=stride
    )


def _as_dtensor(shard: torch.Tensor, spec: ShardSpec, mesh, full_shape: torch.Size) -> DTensor:
    """Give a shard its global identity: the full shape and the dim it is split along."""
    placement = Replicate() if spec.dim is None else Shard(spec.dim)
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(
        shard, mesh, [placement], run_check=False, shape=full_shape, stride=stride
    )
