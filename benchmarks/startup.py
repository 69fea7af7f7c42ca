"""Start-up: seconds to materialise and initialise one rank's model part, before and after.

"before" is the previous build: every parameter of the stage drawn whole from its own
``torch.Generator`` on the CPU, then sliced to the rank's shard. "after" is
:func:`boostlr.parallel.build.materialize`: only the rank's shards, each drawn alone from the
counter-based generator, on ``--device``. Both run in this one process as tensor-parallel
rank ``--rank`` of ``--tp`` (no process group: only the draws and copies are timed).

    python benchmarks/startup.py                        # CoLA-7B, tp 4, rank 0, one stage
    python benchmarks/startup.py --pp 2 --stage 1       # the second of two pipeline stages
    python benchmarks/startup.py --preset 30B --tp 8 --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import time
from types import SimpleNamespace

import torch
from common import machine

from boostlr.config import build_config
from boostlr.models.init import init_rule
from boostlr.models.llama import LlamaModel
from boostlr.models.placement import stage_layers
from boostlr.parallel.build import materialize
from boostlr.parallel.collectives import GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.ledger import CommLedger
from boostlr.parallel.sharding import shard_box
from boostlr.parallel.tensor_parallel import TensorParallelModel


def rank_comm(rank: int, size: int) -> GroupComm:
    """A tensor-parallel group handle that says ``rank`` of ``size`` without a process group."""
    comm = GroupComm(None, "tp", CommLedger())
    object.__setattr__(comm, "_size", size)
    object.__setattr__(comm, "_rank", rank)
    return comm


def meta_part(args: argparse.Namespace) -> TensorParallelModel:
    overrides = [
        ("model.preset", args.preset),
        ("model.arch", args.arch),
        ("model.vocab_size", str(args.vocab)),
        ("parallel.tp", str(args.tp)),
        ("parallel.pp", str(args.pp)),
    ]
    cfg = build_config(overrides=overrides)
    layers = stage_layers(cfg.model.n_layers, cfg.parallel.num_stages, args.stage)
    last = args.stage == cfg.parallel.num_stages - 1
    meta = LlamaModel(cfg.model, device="meta", layers=layers, first=args.stage == 0, last=last)
    ctx = TPContext.from_config(rank_comm(args.rank, args.tp), cfg)
    strategy = cfg.parallel.strategy_for(cfg.model.arch) if args.tp > 1 else None
    return TensorParallelModel(meta, strategy, ctx)


def before(part: TensorParallelModel, seed: int, device: torch.device) -> int:
    """The previous build: each full parameter from a seeded CPU generator, then its shard."""
    tp, rank = part.ctx.comm.size, part.ctx.comm.rank
    drawn = 0
    for name, param in list(part.model.named_parameters()):
        rule = init_rule(part.cfg, name)
        if isinstance(rule, float):
            digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            full = torch.randn(param.shape, generator=gen) * rule
            drawn += full.numel()
        else:
            full = (torch.ones if rule == "ones" else torch.zeros)(param.shape)
        box = shard_box(full.shape, part.specs[name], rank, tp)
        shard = full[tuple(slice(a, b) for a, b in box)].clone().to(device)
        del full
        path, _, attr = name.rpartition(".")
        owner = part.model.get_submodule(path) if path else part.model
        setattr(owner, attr, torch.nn.Parameter(shard))
    return drawn


def after(part: TensorParallelModel, seed: int, device: torch.device) -> int:
    comms = SimpleNamespace(tp_mesh=None, tp=part.ctx.comm)
    materialize(part, seed, comms, device)
    named = part.model.named_parameters()
    return sum(p.numel() for n, p in named if isinstance(init_rule(part.cfg, n), float))


def timed(fn, args: argparse.Namespace, device: torch.device) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, elements drawn at random).

    The CPU seconds are the rank's own work, which other jobs on a shared machine do not
    inflate (with one thread they are the wall time of an idle machine).
    """
    part = meta_part(args)
    started, cpu = time.perf_counter(), time.process_time()
    drawn = fn(part, 0, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, time.process_time() - cpu, drawn


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="7B")
    ap.add_argument("--arch", default="cola")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="as torchrun's OMP_NUM_THREADS=1")
    ap.add_argument("--only", choices=("before", "after"), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(machine())
    print(
        f"{args.preset} {args.arch}, pp {args.pp} stage {args.stage}, tp {args.tp} rank "
        f"{args.rank}, {args.threads} thread(s), device {device}"
    )
    results = {}
    for label, fn in (("before", before), ("after", after)):
        if args.only in (None, label):
            seconds, cpu, drawn = timed(fn, args, device)
            results[label] = seconds
            print(
                f"{label:>7}: {seconds:8.1f} s wall  {cpu:8.1f} s CPU  "
                f"{drawn / 1e9:6.3f} G elements drawn"
            )
    if len(results) == 2:
        print(f"speed-up (wall): {results['before'] / results['after']:.1f}x")
    return results


if __name__ == "__main__":
    main()
