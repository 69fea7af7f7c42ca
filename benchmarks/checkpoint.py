"""Checkpoint save/load throughput and the time a save blocks training, against fsync.

A dense model of a few hundred MB (weights + AdamW moments) is sharded over 2 and 4 CPU
ranks (tensor parallel, gloo); each rank saves it several times with the trainer's
:class:`CheckpointWriter`, synchronously and asynchronously, then loads it back with DCP.
The floor a save is measured against: each rank writes the same bytes it wrote into the
checkpoint (its shards and RNG file, from memory) to one file and fsyncs it, as many times.
A save hashes while it writes, so its blocking time should stay close to that floor.

Printed per model size and world size, from one run (rank 0's medians): MB/s per rank for
save and load (this rank's shard bytes / wall time), the seconds the caller was blocked per
save (the wall time of ``CheckpointWriter.save``, sync and async), the fsync floor (written
right after each sync save), the median of each save's ratio to the floor written after it
(sync/fsync), and async/sync. A small model shows the fixed cost of a save
(planning, metadata, the ranks' collectives); ``--more-sizes`` adds larger ones in the same
run, where bandwidth dominates as it does at 100+ GB. Disk and page cache dominate on a VM;
the ratios are the numbers to read.

    python benchmarks/checkpoint.py [--saves 3] [--dim 512] [--layers 8] [--vocab 32000]
        [--worlds 2 4] [--more-sizes DIMxLAYERSxVOCAB ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from boostlr.config import build_config, from_dict, to_dict
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.launch import init_distributed, launch
from boostlr.rundir.checkpoint import Checkpoint, load_sharded_state, read_checkpoint
from boostlr.rundir.writer import CheckpointWriter
from boostlr.train.optim import build_optimizer, init_optimizer_state

MB = 1e6


def config(args: argparse.Namespace, world: int):
    """The dense model of ``args``'s size, tensor parallel over ``world`` CPU ranks."""
    overrides = {
        "model.preset": "tiny",
        "model.arch": "full",
        "model.dim": args.dim,
        "model.ffn_dim": args.dim * 11 // 4,
        "model.n_layers": args.layers,
        "model.n_heads": 8,
        "model.n_kv_heads": 8,
        "model.vocab_size": args.vocab,
        "parallel.tp": world,
        "parallel.device": "cpu",
    }
    return build_config(overrides=[(k, str(v)) for k, v in overrides.items()])


def rank_entry(cfg_dict: dict, root: str, saves: int) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg = from_dict(cfg_dict)
    device = torch.device("cpu")
    init_distributed(device, cfg.parallel.world_size)
    rank = dist.get_rank()
    model = ParallelModel.build(cfg, device)
    optimizer = build_optimizer(model.parameters(), cfg.train, fused=False)
    init_optimizer_state(optimizer)
    named = model.named_parameters()
    state = {"model": dict(named), "optim": {n: optimizer.state[p] for n, p in named}}
    local_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for t in [p for _, p in named]
        + [v for s in state["optim"].values() for v in s.values() if v.ndim > 0]
    )
    group = model.comms.ckpt_group
    report: dict = {"rank": rank, "shard_mb": local_bytes / MB}
    for mode in ("sync", "async"):
        ckpt_root = Path(root) / mode
        writer = CheckpointWriter(ckpt_root, rank, group, keep=1, async_save=mode == "async")
        blocked, total, floor = [], [], []
        for i in range(saves):
            dist.barrier()
            started = time.perf_counter()
            rng = {"cpu": torch.get_rng_state()}
            writer.save(i + 1, state, {"step": i + 1}, rng, {}, {})
            blocked.append(time.perf_counter() - started)  # all the caller waited for
            writer.wait()  # time to a published checkpoint (async: training would go on)
            total.append(time.perf_counter() - started)
            if mode == "sync":  # the floor right after each save: the same load on the machine
                floor.append(fsync_floor(writer.last_path, rank, Path(root), 1))
        writer.close()
        report[f"{mode}_block_s"] = statistics.median(blocked)
        report[f"{mode}_save_mb_s"] = local_bytes / MB / statistics.median(total)
        if floor:
            report["fsync_s"] = statistics.median(floor)
            report["sync_fsync"] = statistics.median(
                [b / f for b, f in zip(blocked, floor, strict=True)]
            )
    ckpt: Checkpoint = read_checkpoint(Path(root) / "sync" / f"step_{saves}")
    loads = []
    for _ in range(saves):
        dist.barrier()
        started = time.perf_counter()
        load_sharded_state(ckpt, state, group)
        loads.append(time.perf_counter() - started)
    report["load_mb_s"] = local_bytes / MB / statistics.median(loads)
    dist.destroy_process_group()
    return report


def fsync_floor(ckpt: Path, rank: int, root: Path, repeats: int) -> float:
    """Median seconds to write (and fsync) the bytes this rank wrote into ``ckpt``."""
    meta = json.loads((ckpt / "meta.json").read_text())
    mine = [
        n for n in meta["files"] if n.startswith(f"__{rank}_") or n == f"rng_rank{rank}.safetensors"
    ]
    data = b"".join((ckpt / name).read_bytes() for name in sorted(mine))
    times = []
    for i in range(repeats):
        dist.barrier()
        target = root / f"fsync_rank{rank}_{i}.bin"
        started = time.perf_counter()
        with open(target, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        times.append(time.perf_counter() - started)
        target.unlink()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--more-sizes",
        nargs="*",
        default=[],
        metavar="DIMxLAYERSxVOCAB",
        help="further model sizes measured after --dim/--layers/--vocab, e.g. 512x8x32000",
    )
    args = parser.parse_args()
    sizes = [(args.dim, args.layers, args.vocab)]
    for text in args.more_sizes:
        try:
            dim, layers, vocab = (int(v) for v in text.lower().split("x"))
        except ValueError:
            parser.error(f"--more-sizes: {text!r} is not DIMxLAYERSxVOCAB, e.g. 512x8x32000")
        sizes.append((dim, layers, vocab))
    print(
        f"{'size':>14} {'ranks':>5} {'shard MB':>9} {'sync save MB/s':>15} {'async save MB/s':>16} "
        f"{'load MB/s':>10} {'sync block s':>13} {'async block s':>14} {'fsync s':>8} "
        f"{'sync/fsync':>10} {'async/sync':>10}"
    )
    for dim, layers, vocab in sizes:
        shape = argparse.Namespace(dim=dim, layers=layers, vocab=vocab)
        for world in args.worlds:
            root = tempfile.mkdtemp(prefix="boostlr-ckpt-bench-")
            try:
                cfg = config(shape, world)
                results = launch(world, rank_entry, to_dict(cfg), root, args.saves)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            report(f"{dim}x{layers}x{vocab}", world, results[0])


def report(size: str, world: int, r: dict) -> None:
    """One row of the table: rank 0's medians."""
    print(
        f"{size:>14} {world:>5} {r['shard_mb']:>9.1f} {r['sync_save_mb_s']:>15.1f} "
        f"{r['async_save_mb_s']:>16.1f} {r['load_mb_s']:>10.1f} {r['sync_block_s']:>13.3f} "
        f"{r['async_block_s']:>14.3f} {r['fsync_s']:>8.3f} "
        f"{r['sync_fsync']:>10.2f} "
        f"{r['async_block_s'] / r['sync_block_s']:>10.2f}"
    )


if __name__ == "__main__":
    main()
