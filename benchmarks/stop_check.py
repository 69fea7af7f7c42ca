"""What the per-step stop check (``boostlr/train/stopping.py``) costs a step.

Every step ends with one MAX all-reduce of a one-element host tensor over a gloo group of all
ranks, so the ranks agree on the step to save at after a signal or before the time limit.
The all-reduce is started at one step's end and waited for at the next one's, so its
latency hides behind the step. This times, on real gloo ranks, a stand-in step (host
matmuls of a fixed size) with and without the check, in alternating blocks (the median of
the blocks' differences is what the check adds to a step), and the check alone back to
back (its latency, when there is no step to hide it behind).

    PYTHONPATH=src python benchmarks/stop_check.py [--rounds 25] [--worlds 2 4]
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


def _work(a: torch.Tensor, matmuls: int) -> None:
    """A step's stand-in: host compute of a fixed size."""
    for _ in range(matmuls):
        a = torch.tanh(a @ a)


def _rank(rank: int, world: int, port: int, steps: int, rounds: int, matmuls: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stop = StopCheck(stop_group(60.0), None)
    a = torch.randn(128, 128) / 16
    bare, checked, alone = [], [], []
    for _ in range(rounds):  # the two kinds of block alternate: load drifts cancel out
        for times, check in ((bare, False), (checked, True)):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                _work(a, matmuls)
                if check:
                    assert stop.check(0.0) == 0
            times.append((time.perf_counter() - started) / steps)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(steps):
            assert stop.check(0.0) == 0
        alone.append((time.perf_counter() - started) / steps)
    stop.close()
    dist.destroy_process_group()
    if rank == 0:
        added = [c - b for b, c in zip(bare, checked, strict=True)]
        out.put(tuple(statistics.median(x) for x in (bare, checked, added, alone)))


def check_seconds(world: int, steps: int, rounds: int, matmuls: int) -> tuple[float, ...]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, steps, rounds, matmuls, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    for p in procs:
        p.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--matmuls", type=int, default=20, help="a step's size")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f}")
    print("| ranks | step (ms) | step + check (ms) | added per step (us) | check alone (us) |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        bare, checked, added, alone = check_seconds(world, args.steps, args.rounds, args.matmuls)
        print(
            f"| {world} | {bare * 1e3:.2f} | {checked * 1e3:.2f} | {added * 1e6:.0f} | "
            f"{alone * 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
