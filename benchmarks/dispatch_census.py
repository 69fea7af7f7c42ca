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

- ``plan host ops``: the cost model's host ops for that block (its kernels times the
  strategy's ``host_ops_per_kernel``, ``specs/strategy.py``), which the host term charges.

    python benchmarks/dispatch_census.py [--preset 60M] [--seq-len 128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import torch
from common import bench_config

from boostlr.analysis.costmodel import predict
from boostlr.analysis.hardware import load_profile
from boostlr.config import RunConfig, from_dict, to_dict
from boostlr.host_ops import step_census

STRATEGIES = [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")]
TP = 2


def config(args: argparse.Namespace, arch: str, strategy: str, layers: int) -> RunConfig:
    args = argparse.Namespace(**{**vars(args), "batch_size": 1})
    extra = {"train.dtype": args.dtype, "parallel.tp": TP, "parallel.tp_strategy": strategy}
    cfg = bench_config(args, arch, extra)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers))


def rank_entry(cfg_dicts: list[dict]) -> list[dict[str, int]]:
    """Per config: the outermost aten ops of one profiled step, by class."""
    import torch.distributed as dist

    from boostlr.parallel.launch import init_distributed

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = torch.device("cpu")
    init_distributed(device, TP)
    torch.set_num_threads(1)
    out = [dict(step_census(from_dict(d), device)) for d in cfg_dicts]
    dist.destroy_process_group()
    return out


def plan_counts(cfg: RunConfig) -> tuple[int, float]:
    """The cost model's (kernels, host ops) per step (``fixed.kernels_per_step``: GEMMs
    forward and backward, the non-GEMM estimate, a copy per TP collective; and
    ``fixed.host_ops_per_step``: those times the strategy's ops per kernel). Neither depends
    on the hardware profile."""
    fixed = predict(cfg, load_profile("h200")).fixed
    return fixed["kernels_per_step"], fixed["host_ops_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    from boostlr.parallel.launch import launch

    cfgs = [config(args, a, s, n) for a, s in STRATEGIES for n in (1, 2)]
    ranks = launch(TP, rank_entry, [to_dict(c) for c in cfgs], env={"OMP_NUM_THREADS": "1"})
    counts = ranks[0]
    m = cfgs[2].model  # cola: the rank
    print(
        f"# dispatch_census: {args.preset} (d {m.dim}, rank {m.rank}), seq {args.seq_len}, one "
        f"sequence, {args.dtype}, TP {TP} on {TP} gloo ranks; one block = a 2-block step "
        "minus a 1-block step, rank 0"
    )
    header = (
        f"{'strategy':<16}{'dispatched':>11}{'writes':>8}{'views':>7}{'no-op casts':>12}"
        f"{'plan kernels':>13}{'writes / plan':>14}{'dispatched / plan':>18}"
        f"{'plan host ops':>14}{'dispatched / host ops':>22}"
    )
    print(header)
    print("-" * len(header))
    for i, (arch, strategy) in enumerate(STRATEGIES):
        one, two = counts[2 * i], counts[2 * i + 1]
        block = {k: two.get(k, 0) - one.get(k, 0) for k in ("write", "view", "noop")}
        dispatched = sum(block.values())
        (k1, h1), (k2, h2) = plan_counts(cfgs[2 * i]), plan_counts(cfgs[2 * i + 1])
        plan, host = k2 - k1, h2 - h1
        print(
            f"{arch + ' + ' + strategy:<16}{dispatched:>11}{block['write']:>8}{block['view']:>7}"
            f"{block['noop']:>12}{plan:>13}{block['write'] / plan:>14.2f}"
            f"{dispatched / plan:>18.2f}{host:>14.0f}{dispatched / host:>22.2f}"
        )


if __name__ == "__main__":
    main()
