"""One tiny model and one global batch on 8 CPU ranks at several pp x dp x tp layouts.

Prints, side by side from one run, each layout's step time (median of timed steps after
warm-up) and the bytes rank 0 moves per step on each mesh dim. CPU/gloo times on a 2-core
machine measure overheads, not GPU speed; the byte counts are exact and layout-specific.

    python benchmarks/parallel_3d.py [--steps 4] [--arch cola]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from boostlr.config import build_config, from_dict, to_dict
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.launch import init_distributed, launch
from boostlr.train.optim import build_optimizer

LAYOUTS = [  # (pp, dp, tp)
    (1, 8, 1),
    (1, 4, 2),
    (1, 2, 4),
    (2, 2, 2),
    (2, 1, 4),
]
GLOBAL_BATCH, SEQ = 16, 64


def config(arch: str, pp: int, dp: int, tp: int):
    overrides = {
        "model.preset": "tiny",
        "model.arch": arch,
        "model.n_layers": 4,
        "data.seq_len": SEQ,
        "train.batch_size": GLOBAL_BATCH // dp,
        "parallel.pp": pp,
        "parallel.dp": dp,
        "parallel.tp": tp,
        "parallel.device": "cpu",
    }
    cfg = build_config(overrides=[(k, str(v)) for k, v in overrides.items()])
    cfg.model.vocab_size = 4096
    return cfg


def rank_entry(cfg_dict: dict, steps: int) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg = from_dict(cfg_dict)
    device = torch.device("cpu")
    init_distributed(device, cfg.parallel.world_size)
    model = ParallelModel.build(cfg, device)
    opt = build_optimizer(model.parameters(), cfg.train, fused=False)
    gen = torch.Generator().manual_seed(0)
    b = cfg.train.batch_size
    times = []
    for step in range(steps + 1):  # step 0 warms up
        tokens = torch.randint(0, cfg.model.vocab_size, (b, SEQ + 1), generator=gen)
        model.comms.ledger.reset()
        torch.distributed.barrier()
        started = time.perf_counter()
        opt.zero_grad()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        model.clip_gradients(1.0)
        opt.step()
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - started)
    metrics = model.step_metrics()
    torch.distributed.destroy_process_group()
    return {"step_time_s": statistics.median(times), **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--arch", default="cola")
    args = parser.parse_args()
    rows = []
    for pp, dp, tp in LAYOUTS:
        cfg = config(args.arch, pp, dp, tp)
        result = launch(8, rank_entry, to_dict(cfg), args.steps)[0]
        rows.append((f"pp{pp} x dp{dp} x tp{tp}", result))
    base = rows[0][1]["step_time_s"]
    strategy = "btp" if args.arch != "full" else "megatron"
    print(
        f"{args.arch} tiny (d 64, 4 layers), global batch {GLOBAL_BATCH} x seq {SEQ}, 8 gloo "
        f"ranks, {strategy} where tp > 1, 1f1b with 2 micro-batches where pp > 1"
    )
    print(
        f"{'layout':<18}{'step s':>9}{'vs dp8':>8}{'tp bytes':>12}{'dp bytes':>12}{'pp bytes':>11}"
    )
    for label, r in rows:
        print(
            f"{label:<18}{r['step_time_s']:>9.3f}{r['step_time_s'] / base:>7.2f}x"
            f"{r['comm_tp_bytes']:>12,}{r['comm_dp_bytes']:>12,}{r['comm_pp_bytes']:>11,}"
        )


if __name__ == "__main__":
    main()
