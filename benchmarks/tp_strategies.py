"""Tensor-parallel strategies side by side: Megatron (full-rank), vanilla and BTP (CoLA).

One run launches the ranks (torch's elastic launcher, gloo on CPU / NCCL on GPU) and, inside
the same process group, times every configuration in interleaved rounds so machine noise
hits all alike. Per configuration: TP bytes and calls per step (from the communication
ledger), median step time, the share of it rank 0 spent blocked in TP collectives (measured
by the ledger, as ``comm_tp_time_s`` in metrics.jsonl), tokens/s and the activation memory
held at the end of the forward. Then the ratios BTP/vanilla and BTP/Megatron, and an
ablation of BTP's companions.

    python benchmarks/tp_strategies.py                       # T = 2 and 4, CPU
    python benchmarks/tp_strategies.py --tp 8 --device cuda --preset 1B --seq-len 2048
"""

from __future__ import annotations

import argparse
import statistics

CONFIGS: list[tuple[str, str, str, dict]] = [
    # label, arch, strategy, options
    ("megatron (full)", "full", "megatron", {}),
    ("vanilla (cola)", "cola", "vanilla", {}),
    ("btp (cola)", "cola", "btp", {}),
    ("btp, norm=sync", "cola", "btp", {"norm": "sync"}),
    ("btp, grouping=off", "cola", "btp", {"grouping": "false"}),
    ("btp, act_ckpt=lowrank", "cola", "btp", {"act_ckpt": "lowrank"}),
    ("btp, act_ckpt=block", "cola", "btp", {"act_ckpt": "block"}),
]


def _rank(args: argparse.Namespace) -> dict[str, dict]:
    import torch
    import torch.distributed as dist
    from common import Part, bench_config, interleave, random_batch
    from torch.profiler import ProfilerActivity, profile

    from boostlr.parallel.launch import init_distributed

    device = torch.device(args.device)
    init_distributed(device, args.tp)
    inputs, targets = random_batch(args.vocab, args.batch_size, args.seq_len, device)

    parts = {}
    for label, arch, strategy, opts in CONFIGS:
        extra = {"parallel.tp": args.tp, "parallel.tp_strategy": strategy}
        extra |= {f"parallel.{k}": v for k, v in opts.items()}
        parts[label] = Part.build(bench_config(args, arch, extra), device)

    def step(label: str) -> float:
        ledger = parts[label].model.comms.ledger
        dist.barrier()
        ledger.reset()
        return parts[label].step(inputs, targets)[0]

    results: dict[str, dict] = {label: {"comm": []} for label in parts}
    for label, part in parts.items():  # warm-up, and one ledger-recorded step each
        step(label)
        results[label]["ledger"] = part.model.comms.ledger.step_metrics()
        part.model.comms.ledger.take_seconds()  # the warm-up's time is not measured

    def timed(label: str) -> float:
        seconds = step(label)
        comm = parts[label].model.comms.ledger.take_seconds().get("tp", 0.0)
        results[label]["comm"].append(comm)
        return seconds

    for label, times in interleave(list(parts), timed, args.rounds, args.steps).items():
        results[label]["times"] = times
    for label, part in parts.items():
        stage = part.model.stages[0]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = stage(inputs, targets)
        results[label]["act_bytes"] = sum(e.self_cpu_memory_usage for e in prof.events())
        loss.backward()
        part.optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from common import machine

    from boostlr.analysis.comm import per_block_forward
    from boostlr.config import build_config
    from boostlr.parallel.launch import launch

    tokens = args.batch_size * args.seq_len
    for tp in args.tp:
        run_args = argparse.Namespace(**{**vars(args), "tp": tp})
        res = launch(tp, _rank, run_args)[0]
        print(f"\n{machine()}")
        print(
            f"# tp_strategies: T={tp}, preset {args.preset}, seq {args.seq_len}, batch "
            f"{args.batch_size}, vocab {args.vocab}, fp32, {args.steps}x{args.rounds} timed steps, "
            f"device {args.device}"
        )
        header = (
            f"{'config':<24} {'TP MB/step':>11} {'calls':>6} {'recomp MB':>10} "
            f"{'step s':>8} {'comm %':>7} {'tokens/s':>9} {'act MB':>8}"
        )
        print(header)
        print("-" * len(header))
        summary = {}
        for label, _, _, _ in CONFIGS:
            r = res[label]
            t = statistics.median(r["times"])
            share = 100 * sum(r["comm"]) / sum(r["times"])
            summary[label] = (r["ledger"]["comm_tp_bytes"], t, r["act_bytes"])
            print(
                f"{label:<24} {r['ledger']['comm_tp_bytes'] / 2**20:>11.2f} "
                f"{r['ledger']['comm_tp_calls']:>6} "
                f"{r['ledger']['comm_tp_bytes_recompute'] / 2**20:>10.2f} {t:>8.3f} {share:>6.1f}% "
                f"{tokens / t:>9,.0f} {r['act_bytes'] / 2**20:>8.1f}"
            )
        btp, van, meg = summary["btp (cola)"], summary["vanilla (cola)"], summary["megatron (full)"]
        shape = [("model.preset", args.preset)]
        cola = build_config(overrides=shape + [("model.arch", "cola")]).model
        full = build_config(overrides=shape + [("model.arch", "full")]).model
        blk = {s: per_block_forward(cola, s, tp, tokens) for s in ("btp", "vanilla")}
        blk["megatron"] = per_block_forward(full, "megatron", tp, tokens)
        print(
            "per block forward (formula = ledger): "
            f"vanilla/BTP {blk['vanilla'] / blk['btp']:.2f}x, "
            f"BTP/megatron {blk['btp'] / blk['megatron']:.2f}"
        )
        print(
            f"BTP/vanilla: bytes {btp[0] / van[0]:.3f} ({van[0] / btp[0]:.2f}x fewer), "
            f"step time {btp[1] / van[1]:.2f}x\n"
            f"BTP/megatron(full): bytes {btp[0] / meg[0]:.3f}, step time {btp[1] / meg[1]:.2f}x\n"
            f"lowrank ckpt: activations {summary['btp, act_ckpt=lowrank'][2] / btp[2]:.2f}x of "
            f"no checkpointing, step time {summary['btp, act_ckpt=lowrank'][1] / btp[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
