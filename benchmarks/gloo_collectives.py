"""FSDP's gather and reduction on gloo: torch's calls against boostlr's in-place ones.

FSDP all-gathers each unit's parameters into one flat buffer and reduce-scatters its
gradients out of another. gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
work through a temporary the size of that buffer; boostlr's gloo hooks
(``boostlr.parallel.data_parallel``) broadcast each rank's slot in place and all-reduce the
staging buffer in place. For a buffer the size of a large unit (default: CoLA-1B's LM head
at tp 2, 32000 x 2048 / 2 fp32), each rank reports the resident memory a call adds above
what was resident before it (the high-water mark, reset before each call) and its time,
interleaved over rounds; the table gives medians and the ratios to torch's calls.

    python benchmarks/gloo_collectives.py --ranks 2 --numel 32768000
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    from boostlr.parallel.data_parallel import in_place_all_gather, in_place_reduce_scatter
    from boostlr.parallel.launch import init_distributed
    from boostlr.train.memory import current_rss_mb, peak_rss_mb, reset_peak_rss

    device = torch.device("cpu")
    init_distributed(device, args.ranks)
    group, rank = dist.group.WORLD, dist.get_rank()
    full = torch.randn(args.numel)
    shard = full.view(args.ranks, -1)[rank]
    out = torch.randn(args.numel // args.ranks)
    calls = {
        "all-gather: torch": lambda: dist.all_gather_into_tensor(full, shard),
        "all-gather: in place": lambda: in_place_all_gather(full, shard, group, False),
        "reduce-scatter: torch": lambda: dist.reduce_scatter_tensor(out, full),
        "reduce-scatter: in place": lambda: in_place_reduce_scatter(
            out, full, group, dist.ReduceOp.SUM, False
        ),
    }
    seen: dict[str, dict[str, list[float]]] = {k: {"s": [], "mb": []} for k in calls}
    for _ in range(args.rounds):
        for label, call in calls.items():
            dist.barrier()
            reset_peak_rss()
            before = current_rss_mb()
            started = time.perf_counter()
            call()
            seen[label]["s"].append(time.perf_counter() - started)
            seen[label]["mb"].append(peak_rss_mb() - before)
    return {
        k: {"s": statistics.median(v["s"]), "mb": statistics.median(v["mb"])}
        for k, v in seen.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=32768000, help="elements of the buffer")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from common import machine

    from boostlr.parallel.launch import launch

    results = launch(args.ranks, _rank, args)
    print(machine())
    mib = args.numel * 4 / 2**20
    print(f"# gloo_collectives: {args.ranks} ranks, {mib:,.0f} MiB fp32, {args.rounds} rounds")
    print("| call | added resident MiB (largest rank) | time ms (slowest rank) | speed-up |")
    print("|---|---|---|---|")
    for op in ("all-gather", "reduce-scatter"):
        base = max(r[f"{op}: torch"]["s"] for r in results.values())
        for impl in ("torch", "in place"):
            label = f"{op}: {impl}"
            mb = max(r[label]["mb"] for r in results.values())
            s = max(r[label]["s"] for r in results.values())
            print(f"| {label} | {mb:,.0f} | {s * 1e3:,.0f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
