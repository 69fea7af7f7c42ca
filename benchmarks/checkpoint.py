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
from boostlr.rundir.timeouts import CheckpointGroup
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


def rank_entry(cfg_dict: dict, root: str, saves: int, disks: list[str]) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg = from_dict(cfg_dict)
    device = torch.device("cpu")
    init_distributed(device, cfg.parallel.world_size)
    rank = dist.get_rank()
    model = ParallelModel.build(cfg, device)
    optimizer = build_optimizer(model.parameters(), cfg.train, fused=False)
    init_optimizer_state(optimizer)
    with torch.no_grad():  # moments as a trained model has them: bytes a disk cannot compress
        for moments in optimizer.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                moment = moments[name]
                moment = moment.to_local() if hasattr(moment, "to_local") else moment
                moment.normal_()
                if name == "exp_avg_sq":
                    moment.abs_()
    named = model.named_parameters()
    state = {"model": dict(named), "optim": {n: optimizer.state[p] for n, p in named}}
    local_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for t in [p for _, p in named]
        + [v for s in state["optim"].values() for v in s.values() if v.ndim > 0]
    )
    ckpt = CheckpointGroup(dist.get_world_size())  # the trainer's checkpoint group
    ckpt.wait(cfg.parallel.timeout_s)
    group = ckpt.group
    report: dict = {"rank": rank, "shard_mb": local_bytes / MB}
    rng = {"cpu": torch.get_rng_state()}
    for mode in ("sync", "async"):
        for disk in disks if mode == "sync" else disks[:1]:
            where = Path(root) / f"{mode}-{disk}"
            blocked, total, floor = [], [], []
            # Nothing is pruned in the background while timing (a deletion beside the floor
            # slows it). With ``reused`` each write first deletes its own previous one (the
            # save the previous checkpoint, the floor the previous floor file), as a run that
            # keeps one checkpoint does; with ``fresh`` nothing is deleted. Either way the
            # save and the floor meet the disk in the same state.
            writer = CheckpointWriter(where, rank, group, keep=saves, async_save=mode == "async")
            for i in range(saves):
                if disk == "reused" and i > 0:
                    delete_previous(where / f"step_{i}", rank)
                dist.barrier()
                started = time.perf_counter()
                writer.save(i + 1, state, {"step": i + 1}, rng, {}, {})
                blocked.append(time.perf_counter() - started)  # all the caller waited for
                writer.wait()  # time to a published checkpoint (async: training would go on)
                total.append(time.perf_counter() - started)
                if mode == "sync":  # the floor right after each save
                    data = written_bytes(writer.last_path, rank)
                    target = where / "floor" / f"rank{rank}_{i}.bin"
                    if disk == "reused" and i > 0:
                        (where / "floor" / f"rank{rank}_{i - 1}.bin").unlink()
                    floor.append(fsync_floor(data, target))
            writer.close()
            key = mode if mode == "async" else f"{mode}_{disk}"
            report[f"{key}_block_s"] = statistics.median(blocked)
            report[f"{key}_save_mb_s"] = local_bytes / MB / statistics.median(total)
            if floor:
                report[f"{key}_fsync_s"] = statistics.median(floor)
                ratios = [b / f for b, f in zip(blocked, floor, strict=True)]
                report[f"{key}_ratio"] = statistics.median(ratios)
    ckpt: Checkpoint = read_checkpoint(Path(root) / f"sync-{disks[0]}" / f"step_{saves}")
    loads = []
    for _ in range(saves):
        dist.barrier()
        started = time.perf_counter()
        load_sharded_state(ckpt, state, group)
        loads.append(time.perf_counter() - started)
    report["load_mb_s"] = local_bytes / MB / statistics.median(loads)
    dist.destroy_process_group()
    return report


def delete_previous(ckpt: Path, rank: int) -> None:
    """Rank 0 deletes the previous checkpoint before the next save (the others wait)."""
    if rank == 0:
        shutil.rmtree(ckpt)
    dist.barrier()


def written_bytes(ckpt: Path, rank: int) -> bytes:
    """The bytes of the files this rank wrote into ``ckpt`` (its shards and RNG file)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    mine = [
        n for n in meta["files"] if n.startswith(f"__{rank}_") or n == f"rng_rank{rank}.safetensors"
    ]
    return b"".join((ckpt / name).read_bytes() for name in sorted(mine))


def fsync_floor(data: bytes, target: Path) -> float:
    """Seconds to write ``data`` from memory to a new file and fsync it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    started = time.perf_counter()
    with open(target, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - started


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
    parser.add_argument(
        "--disk",
        nargs="+",
        choices=["reused", "fresh"],
        default=["reused", "fresh"],
        help="write onto blocks just freed (a run that prunes old checkpoints) and/or onto "
        "new ones; a VM's disk can write the two at very different speeds",
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
        f"{'size':>14} {'ranks':>5} {'disk':>6} {'shard MB':>9} {'sync save MB/s':>15} "
        f"{'load MB/s':>10} {'sync block s':>13} {'fsync s':>8} {'sync/fsync':>10} "
        f"{'async block s':>14} {'async/sync':>10}"
    )
    for dim, layers, vocab in sizes:
        shape = argparse.Namespace(dim=dim, layers=layers, vocab=vocab)
        for world in args.worlds:
            root = tempfile.mkdtemp(prefix="boostlr-ckpt-bench-")
            try:
                cfg = config(shape, world)
                results = launch(world, rank_entry, to_dict(cfg), root, args.saves, args.disk)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for disk in args.disk:
                report(f"{dim}x{layers}x{vocab}", world, disk, results[0])


def report(size: str, world: int, disk: str, r: dict) -> None:
    """One row of the table: rank 0's medians (async saves are timed on ``--disk``'s first)."""
    sync = f"sync_{disk}"
    print(
        f"{size:>14} {world:>5} {disk:>6} {r['shard_mb']:>9.1f} {r[sync + '_save_mb_s']:>15.1f} "
        f"{r['load_mb_s']:>10.1f} {r[sync + '_block_s']:>13.3f} {r[sync + '_fsync_s']:>8.3f} "
        f"{r[sync + '_ratio']:>10.2f} {r['async_block_s']:>14.3f} "
        f"{r['async_block_s'] / r[sync + '_block_s']:>10.2f}"
    )


if __name__ == "__main__":
    main()
