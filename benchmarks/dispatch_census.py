"""What one block dispatches on the host at TP 2, against the plan's kernel estimate.

The cost model charges a launch per *kernel* (``gemms.block_kernels`` plus the block's
GEMMs): what a GPU runs. The host dispatches more than that: views, casts to the dtype a
tensor already has, composite ops that call others. Each costs host time whether or not it
launches anything, and where the step is host-bound (one sequence per micro-batch, or any
step on a CPU) that time is the step's fixed cost (issue 47).

Per strategy (``full`` + ``megatron``, ``cola`` + ``vanilla``, ``cola`` + ``btp``) at TP 2 on
two gloo ranks, one trainer step (zero_grad, forward + backward, clipping, AdamW) is
profiled at one block and at two; the difference is one block's. Counted on rank 0:

- ``dispatched``: every aten op called from Python or autograd (the outermost aten ops);
- ``writes``: those minus views and no-op casts: an op that writes memory (the kernel
  count a GPU would launch for the block);
- ``views`` and ``no-op casts``: the rest (an ``aten::to`` or ``contiguous`` that calls no
  other op returned its input);
- ``plan kernels``: the cost model's kernels per step at two blocks minus at one (its
  ``fixed.kernels_per_step``): the block's GEMMs forward and backward, its non-GEMM
  kernels (``gemms.block_kernels``), a copy per TP collective.

    python benchmarks/dispatch_census.py [--preset 60M] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging

import torch
from common import bench_config

from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import load_profile
from boostlr.config import RunConfig, from_dict, to_dict

STRATEGIES = [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")]
TP = 2
VIEWS = frozenset(
    "aten::" + name
    for name in (
        "view", "view_as", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose",
        "permute", "expand", "expand_as", "slice", "select", "narrow", "as_strided", "unsqueeze",
        "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind",
        "detach", "alias", "lift_fresh", "mT", "numpy_T", "result_type",
    )
)  # fmt: skip
MAYBE_NOOP = frozenset({"aten::to", "aten::contiguous", "aten::type_as"})


def config(args: argparse.Namespace, arch: str, strategy: str, layers: int) -> RunConfig:
    args = argparse.Namespace(**{**vars(args), "batch_size": 1})
    extra = {"train.dtype": "float32", "parallel.tp": TP, "parallel.tp_strategy": strategy}
    cfg = bench_config(args, arch, extra)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers))


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _outermost(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_aten(parent):
            return False
        parent = parent.cpu_parent
    return True


def classify(event) -> str:
    """``view``, ``noop`` (a cast or contiguous that called nothing) or ``write``."""
    if event.name in VIEWS:
        return "view"
    if event.name in MAYBE_NOOP and not any(_is_aten(c) for c in event.cpu_children):
        return "noop"
    return "write"


def rank_entry(cfg_dicts: list[dict]) -> list[dict[str, int]]:
    """Per config: the outermost aten ops of one profiled step, by class."""
    import torch.distributed as dist
    from common import Part, random_batch
    from torch.profiler import ProfilerActivity, profile

    from boostlr.parallel.launch import init_distributed

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = torch.device("cpu")
    init_distributed(device, TP)
    torch.set_num_threads(1)
    out = []
    for d in cfg_dicts:
        cfg = from_dict(d)
        part = Part.build(cfg, device)
        inputs, targets = random_batch(
            cfg.model.vocab_size, cfg.train.batch_size, cfg.data.seq_len, device
        )
        for _ in range(2):  # warm-up: the optimizer's state exists, caches are filled
            part.step(inputs, targets)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            part.step(inputs, targets)
        kinds = collections.Counter(
            classify(e) for e in prof.events() if _is_aten(e) and _outermost(e)
        )
        out.append(dict(kinds))
        del part
    dist.destroy_process_group()
    return out


def plan_kernels(cfg: RunConfig) -> int:
    """The cost model's kernels per step (``fixed.kernels_per_step``: GEMMs forward and
    backward, the non-GEMM estimate, a copy per TP collective). The count does not depend on
    the hardware profile."""
    return predict(cfg, load_profile("h200")).fixed["kernels_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()

    from boostlr.parallel.launch import launch

    cfgs = [config(args, a, s, n) for a, s in STRATEGIES for n in (1, 2)]
    ranks = launch(TP, rank_entry, [to_dict(c) for c in cfgs], env={"OMP_NUM_THREADS": "1"})
    counts = ranks[0]
    m = cfgs[2].model  # cola: the rank
    print(
        f"# dispatch_census: {args.preset} (d {m.dim}, rank {m.rank}), seq {args.seq_len}, one "
        f"sequence, fp32, TP {TP} on {TP} gloo ranks; one block = a 2-block step minus a "
        "1-block step, rank 0"
    )
    header = (
        f"{'strategy':<16}{'dispatched':>11}{'writes':>8}{'views':>7}{'no-op casts':>12}"
        f"{'plan kernels':>13}{'writes / plan':>14}{'dispatched / plan':>18}"
    )
    print(header)
    print("-" * len(header))
    for i, (arch, strategy) in enumerate(STRATEGIES):
        one, two = counts[2 * i], counts[2 * i + 1]
        block = {k: two.get(k, 0) - one.get(k, 0) for k in ("write", "view", "noop")}
        dispatched = sum(block.values())
        plan = plan_kernels(cfgs[2 * i + 1]) - plan_kernels(cfgs[2 * i])
        print(
            f"{arch + ' + ' + strategy:<16}{dispatched:>11}{block['write']:>8}{block['view']:>7}"
            f"{block['noop']:>12}{plan:>13}{block['write'] / plan:>14.2f}"
            f"{dispatched / plan:>18.2f}"
        )


if __name__ == "__main__":
    main()
