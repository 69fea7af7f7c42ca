"""One rank's view of two training steps: peak tensor bytes per phase and every collective.

The same body runs on a fake rank (:mod:`boostlr.trace.fake_world`: a fake process
group, fake tensors) and on a real gloo rank (the test that holds the trace to reality), so
both are measured by one :class:`~boostlr.trace.counter.StorageCounter` and one
ledger. The step is the trainer's (``train/loop.py``): zero the gradients, ``grad_accum``
micro-batches of forward + backward under the run's autocast, the global loss, clipping,
AdamW; the second step runs with the optimizer state the first one made.

A traced step runs at most :data:`MICRO_TRACED` micro-batches: the first makes the
gradients, the second accumulates into them, and every later one repeats the second's
operators on the same live tensors (same peak, same collectives). The ledger then repeats
the last micro-batch's records for the ones not run, so a step's records are the whole
step's; the real-rank test runs every micro-batch and compares. A paper config's
``global_batch`` can mean 64 micro-batches a step, each a few seconds of fake dispatch.

FSDP is given torch's own all-gather and reduce-scatter (what an NCCL rank runs), never the
gloo-only in-place path, whatever the backend: :func:`torch_fsdp_collectives`.
"""

from __future__ import annotations

import resource
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.device_mesh import init_device_mesh

from boostlr._torch_internals import unflatten_mesh
from boostlr.config import RunConfig
from boostlr.parallel.build import build_stages
from boostlr.parallel.collectives import CommLedger
from boostlr.parallel.data_parallel import fsdp_units_by_group, set_fsdp_collectives
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.mesh import (
    EXPERT_DIMS,
    MESH_DIMS,
    MeshComms,
    comms_on,
    expert_mesh_shape,
    mesh_coordinates,
    mesh_shape,
)
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.train.optim import build_optimizer

PHASES = ("build", "forward", "backward", "optimizer", "step2")
MICRO_TRACED = 2  # micro-batches a fake step runs; later ones repeat the second


@dataclass
class RankTrace:
    """What one rank did: peaks per phase (bytes) and step 2's collectives, in order."""

    rank: int
    pp_stage: int
    dp_rank: int
    tp_rank: int
    peaks: dict[str, int] = field(default_factory=dict)
    # Allocator rounding of the storages live at the peak (512-byte blocks, 2 MiB above 1 MiB).
    peak_rounded: int = 0
    held_after: int = 0  # bytes live after the second step (parameters, grads, AdamW)
    records: list[dict] = field(default_factory=list)  # step 2's ledger, in order
    steps_equal: bool = True  # step 1 sent the same collectives as step 2
    host_rss_bytes: int = 0  # this process's peak resident memory (Linux: ru_maxrss in KiB)
    wall_s: float = 0.0  # seconds the traced process spent on the build and both steps
    micro_run: int = 0  # micro-batches run per step (the ledger repeats the last for the rest)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values(), default=0)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes per group: tp, dp, pp, and ep and dp_rep where the step used them (MoE)."""
        out = dict.fromkeys((*MESH_DIMS, *EXPERT_DIMS), 0)
        for r in self.records:
            out[r["group"]] += r["bytes"]
        used = [k for k in EXPERT_DIMS if any(r["group"] == k for r in self.records)]
        return {k: out[k] for k in ("tp", "dp", "pp", *used)}

    def as_dict(self) -> dict:
        return asdict(self)


def coordinates(cfg: RunConfig, rank: int) -> tuple[int, int, int]:
    """(pp, dp, tp) coordinates of a global rank: the mesh is laid out tp-fastest."""
    at = mesh_coordinates(cfg.parallel, rank)
    return at["pp"], at["dp"], at["tp"]


def mesh_on_default_group(cfg: RunConfig, device_type: str = "cpu") -> MeshComms:
    """The run's mesh (:func:`~boostlr.parallel.mesh.mesh_shape`) on the default group's
    backend (a fake world's), with the experts' view of it at ``parallel.ep > 1``."""
    p = cfg.parallel
    shape = mesh_shape(p)
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    if p.ep == 1:
        return comms_on(mesh)
    sizes = tuple(expert_mesh_shape(p)[n] for n in EXPERT_DIMS)
    return comms_on(mesh, unflatten_mesh(mesh, "dp", sizes, EXPERT_DIMS, {}))


def torch_fsdp_collectives(stages: list[TensorParallelModel], comms: MeshComms) -> None:
    """Every FSDP unit runs torch's own (NCCL-style) collectives, still recorded (on its own
    group: the routed experts' units on dp_rep)."""
    for units, comm in fsdp_units_by_group(stages, comms):
        set_fsdp_collectives(units, comm, in_place=False)


def _records(ledger: CommLedger) -> list[dict]:
    return [
        {"op": r.op, "group": r.group, "phase": r.phase, "bytes": r.bytes, "tag": r.tag}
        for r in ledger.records
    ]


def repeat_last_micro(records: list[dict], starts: list[int], extra: int) -> list[dict]:
    """``records`` with the last micro-batch's span (``starts[-2]:starts[-1]``) repeated
    ``extra`` more times right after it: the micro-batches a step did not run."""
    if extra <= 0 or len(starts) < 2:
        return records
    a, b = starts[-2], starts[-1]
    return records[:b] + records[a:b] * extra + records[b:]


def two_steps(
    cfg: RunConfig,
    comms: MeshComms,
    counter,
    rank: int,
    batch=None,
    device: torch.device | None = None,
    micro_limit: int | None = None,
) -> RankTrace:
    """Build this rank's model and run two steps; ``counter`` must already be counting.

    ``batch(step, micro)`` gives ``(inputs, targets)``; by default random token ids of the
    config's shape (their values change nothing a trace measures). ``device`` (default the
    CPU) is where the model and batch live: fake CUDA tensors take CUDA's code paths.
    ``micro_limit``: run at most that many micro-batches a step (at least 2) and repeat the
    last one's records for the rest (None: run all ``grad_accum``).
    """
    device = device or torch.device("cpu")
    t = cfg.train
    pp_stage, dp_rank, tp_rank = coordinates(cfg, rank)
    if batch is None:
        vocab, shape = cfg.model.vocab_size, (t.batch_size, cfg.data.seq_len)

        def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.randint(0, vocab, shape, device=device),
                torch.randint(0, vocab, shape, device=device),
            )

    counter.phase("build")
    # A fake tensor has no values: drawing them (and the draw's data-dependent split) is moot.
    stages = build_stages(cfg, comms, device, comms.pp.rank, draw=counter.fake_mode is None)
    torch_fsdp_collectives(stages, comms)
    model = ParallelModel(cfg, comms, stages, device)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    bf16 = t.dtype == "bfloat16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    run = t.grad_accum if micro_limit is None else min(t.grad_accum, max(2, micro_limit))
    steps: list[list[dict]] = []
    for step in (1, 2):
        comms.ledger.reset()
        optimizer.zero_grad(set_to_none=True)
        counter.phase("forward" if step == 1 else "step2")
        counter.backward_phase = "backward" if step == 1 else None
        total = torch.zeros((), device=device)
        starts = []
        for micro in range(run):
            starts.append(len(comms.ledger.records))
            inputs, targets = batch(step, micro)
            with autocast:
                total += model.forward_backward(inputs, targets)
        starts.append(len(comms.ledger.records))
        counter.backward_phase = None
        model.reduce_expert_gradients()  # as the trainer's step: expert grads over dp_rep
        if step == 1:
            counter.phase("optimizer")
        model.global_mean(total / t.grad_accum)
        model.clip_gradients(t.grad_clip)
        optimizer.step()
        steps.append(repeat_last_micro(_records(comms.ledger), starts, t.grad_accum - run))
    return RankTrace(
        rank=rank,
        pp_stage=pp_stage,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        peaks={k: counter.peaks.get(k, 0) for k in PHASES},
        peak_rounded=counter.peak_rounded,
        held_after=counter.current,
        records=steps[1],
        steps_equal=steps[0] == steps[1],
        host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        micro_run=run,
    )
