"""What the per-step stop check (``boostlr/train/stopping.py``) costs a step.

Every step ends with one MAX all-reduce of a one-element host tensor over a gloo group of all
ranks, so the ranks agree on the step to save at after a signal or before the time limit.
This times that check on real gloo ranks on this machine (median of several rounds of
``--checks`` back-to-back checks), beside a barrier on the same group (the least any
collective over all ranks costs), and prints their ratio. On GPUs the check overlaps the
device's work (nothing waits for the device); the number is the CPU time a step's host
thread spends in it.

    PYTHONPATH=src python benchmarks/stop_check.py [--checks 2000] [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boostlr.train.stopping import StopCheck, stop_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, checks: int, rounds: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stop = StopCheck(stop_group(60.0), None)
    per_check, per_barrier = [], []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(checks):
            assert stop.check(0.0) == 0
        per_check.append((time.perf_counter() - started) / checks)
        started = time.perf_counter()
        for _ in range(checks):
            dist.barrier(group=stop.group)
        per_barrier.append((time.perf_counter() - started) / checks)
    stop.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put((statistics.median(per_check), statistics.median(per_barrier)))


def check_seconds(world: int, checks: int, rounds: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, checks, rounds, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    for p in procs:
        p.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f}")
    print("| ranks | stop check (us/step) | gloo barrier (us) | check / barrier |")
    print("|---|---|---|---|")
    for world in args.worlds:
        check, barrier = check_seconds(world, args.checks, args.rounds)
        print(f"| {world} | {check * 1e6:.0f} | {barrier * 1e6:.0f} | {check / barrier:.2f} |")


if __name__ == "__main__":
    main()
