"""Every collective of a pp2 x dp2 x tp2 step, rank by rank in a fake world, compared across ranks.

NCCL pairs the k-th collective one rank issues on a group with the k-th every other member
issues there (and a rank's k-th send to a peer with that peer's k-th receive from it); when
their element counts or dtypes differ, a real run hangs or reads garbage, and one GPU never
shows it. So each rank of the layout is traced as ``boostlr plan --trace`` traces one (the trace
package: a fake process group of the whole world, fake tensors, the trainer's build and two
steps), on the device under test (fake CUDA tensors take CUDA's code paths: autocast's,
attention's, FSDP's), while a dispatch mode records every ``c10d`` and functional-collective
operator with its group's global ranks, its peer and its tensors' shapes and dtypes; then
:func:`compare` pairs the calls up across ranks (counts and dtypes: what NCCL pairs).

    python benchmarks/gpu_collectives.py --device cuda --out DIR   # gpu_check runs this
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

LAYOUT = {"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 2, "parallel.microbatches": 2}
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_CALLS = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping, nothing sent
SENDS, RECVS = ("send",), ("recv_", "recv_any_source_")


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it: ``peer`` is a global rank (point-to-point) or -1."""

    op: str
    members: tuple[int, ...]
    peer: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def signature(self) -> tuple:
        """What NCCL pairs: the operator, each tensor's element count and dtype."""
        return (self.op, tuple(math.prod(s) for s in self.shapes), self.dtypes)


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _tensors(x, out)
    return out


class CollectiveRecorder(TorchDispatchMode):
    """Records each collective operator dispatched while active, in call order."""

    def __init__(self, groups: dict[str, tuple[int, ...]]):
        super().__init__()
        self.groups = dict(groups)  # group name -> global ranks (functional ops name groups)
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES and func._opname not in NOT_CALLS:
            self.calls.append(self._call(func, args, kwargs))
        return func(*args, **kwargs)

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Call:
        named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
        named.update(kwargs)
        group, members, peer = None, (), -1
        for value in named.values():
            if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
                group = dist.ProcessGroup.unbox(value)
        if group is not None:
            members = tuple(dist.get_process_group_ranks(group))
            self.groups.setdefault(group.group_name, members)
        elif isinstance(named.get("group_name"), str):
            members = self.groups.get(named["group_name"], (named["group_name"],))
        op = func._opname
        if op in SENDS + RECVS and group is not None:
            local = named.get("dst", named.get("src"))
            peer = dist.get_global_rank(group, local) if isinstance(local, int) else -1
        tensors = [t for v in named.values() for t in _tensors(v, [])]
        shapes = tuple(tuple(t.shape) for t in tensors)
        return Call(op, members, peer, shapes, tuple(str(t.dtype) for t in tensors))


def compare(ranks: dict[int, list[Call]], notes: list[str] | None = None) -> list[str]:
    """Mismatches between the traced ranks' calls, one line each (none: all pair up).

    Group collectives pair up by group (its global ranks) and call order: every traced
    member must issue as many, each with the same operator and, tensor by tensor, the same
    element count and dtype. A send pairs with the peer's receive from the sender on the
    same group, in order: same counts and dtypes. Shapes that differ at equal counts (torch
    2.11's pipeline stages greet each other with a 0-d send into a 1-element receive) are
    what NCCL never sees: they go to ``notes``, not the mismatches."""
    notes = [] if notes is None else notes
    streams: dict[tuple, dict[int, list[Call]]] = {}
    sent: dict[tuple, list[Call]] = {}
    received: dict[tuple, list[Call]] = {}
    for rank, calls in sorted(ranks.items()):
        for c in calls:
            if c.op in SENDS:
                sent.setdefault((c.members, rank, c.peer), []).append(c)
            elif c.op in RECVS:
                received.setdefault((c.members, c.peer, rank), []).append(c)
            else:
                streams.setdefault(c.members, {}).setdefault(rank, []).append(c)
    problems = []
    for members, per_rank in sorted(streams.items(), key=str):
        for m in members:
            if isinstance(m, int) and m in ranks:
                per_rank.setdefault(m, [])
        first, *others = sorted(per_rank)
        for other in others:
            a, b = per_rank[first], per_rank[other]
            where = f"group {members}"
            if len(a) != len(b):
                problems.append(
                    f"{where}: rank {first} issued {len(a)} collectives, rank {other} {len(b)}"
                )
            problems += _pairs(
                zip(a, b, strict=False), where, f"rank {first}", f"rank {other}", notes
            )
    for key in sorted(set(sent) | set(received), key=str):
        members, src, dst = key
        if src not in ranks or dst not in ranks:
            continue
        s, r = sent.get(key, []), received.get(key, [])
        if len(s) != len(r):
            problems.append(f"{src} -> {dst}: {len(s)} sends, {len(r)} receives")
        # A receive pairs with a send: the operators differ by design, counts and dtypes not.
        pairs = (
            (x, Call(x.op, y.members, y.peer, y.shapes, y.dtypes))
            for x, y in zip(s, r, strict=False)
        )
        problems += _pairs(pairs, f"{src} -> {dst}", "sent", "received into", notes)
    return problems


def _pairs(pairs, where: str, a_name: str, b_name: str, notes: list[str]) -> list[str]:
    """The first pair whose signatures differ (a mismatch); shape-only differences noted."""
    for k, (x, y) in enumerate(pairs):
        if x.signature() != y.signature():
            return [
                f"{where}, call {k}: {a_name} {x.op} {x.shapes} {x.dtypes}, "
                f"{b_name} {y.op} {y.shapes} {y.dtypes}"
            ]
        if x.shapes != y.shapes:
            notes.append(f"{where}, call {k}: shapes {x.shapes} and {y.shapes}, counts equal")
    return []


def layout_config(device: str, preset: str = "tiny"):
    """The traced layout: pp2 x dp2 x tp2, bf16, FSDP and BTP, as a cluster run would set."""
    from boostlr.analysis.costmodel import planning_config
    from boostlr.config import build_config

    pairs = {
        **LAYOUT,
        "model.preset": preset,
        "model.arch": "cola",
        "parallel.device": device,
        "parallel.tp_strategy": "btp",
        "train.dtype": "bfloat16",
        "train.batch_size": 2,
        "data.seq_len": 32,
    }
    # The preset's vocabulary, as ``plan --trace`` takes it when the config leaves it to data.
    return planning_config(build_config(overrides=[(k, str(v)) for k, v in pairs.items()]))


def trace_rank_calls(cfg, rank: int, device: torch.device) -> list[Call]:
    """Trace ``rank`` in this process (a fake world it tears down again), recording calls."""
    from boostlr.trace.counter import StorageCounter, counting
    from boostlr.trace.fake_world import fake_tensors, init_fake_world
    from boostlr.trace.rank import mesh_on_default_group, two_steps

    init_fake_world(rank, cfg.parallel.world_size)
    try:
        comms = mesh_on_default_group(cfg, device.type)
        groups = {dist.group.WORLD.group_name: tuple(range(cfg.parallel.world_size))}
        for c in (comms.tp, comms.dp, comms.pp):
            if c.group is not None:
                groups[c.group.group_name] = tuple(dist.get_process_group_ranks(c.group))
        with fake_tensors() as mode:
            counter = StorageCounter(mode)
            with counting(counter), CollectiveRecorder(groups) as recorder:
                two_steps(cfg, comms, counter, rank, device=device)
        return recorder.calls
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", required=True, metavar="DIR")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = layout_config(args.device)
    device = torch.device(args.device)
    ranks = {r: trace_rank_calls(cfg, r, device) for r in range(cfg.parallel.world_size)}
    notes: list[str] = []
    problems = compare(ranks, notes)
    report = {
        "layout": LAYOUT,
        "device": args.device,
        "calls": {r: len(c) for r, c in ranks.items()},
        "problems": problems,
        "notes": notes,
        "ranks": {r: [asdict(c) for c in calls] for r, calls in ranks.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.json").write_text(json.dumps(report, indent=1))
    print(
        f"{sum(report['calls'].values())} collectives on {len(ranks)} ranks; "
        f"{len(problems)} mismatches" + "".join(f"\n  {p}" for p in problems[:10])
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
