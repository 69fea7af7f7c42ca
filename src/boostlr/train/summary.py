"""What ``boostlr train`` says before its first step: what it trains, where, on what.

A new user (or a job log read the next morning) sees the model, its size, the layout and
device, the data and the run directory up front, and what the ``mem … / floor …`` of the
step lines means, instead of inferring them from the config. Printed once, by the process
that starts the run (rank 0 under torchrun/srun); ``--quiet`` prints nothing but a note that
an option given is not used (``parallel.max_restarts`` under a launcher), on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from boostlr.config import RunConfig
from boostlr.models.counting import count_params

MEM_LEGEND = (
    "step lines: mem = rank 0's peak memory in MB (CUDA: the allocator's peak; CPU: peak RSS) "
    "/ floor = what its parameters, gradients, optimizer state and runtime hold "
    "(docs/metrics.md)"
)


def startup_lines(
    cfg: RunConfig,
    run_dir: Path,
    data: Path,
    device: torch.device,
    resume: bool,
    decisions: list[str] | None = None,
) -> list[str]:
    """The lines printed before training: model, layout and device, what resolution decided
    (``decisions``: ``parallel.dp_mode auto``'s choice and why), data and run dir, legend."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    arch = m.arch + (f" rank {m.rank}" if m.lowrank and m.rank else "")
    params = count_params(m).total
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    source = "" if cfg.data.path else ", the default corpus"
    strategy = p.strategy_for(m.arch)
    layout = f"pp{p.pp} x dp{p.dp} x tp{p.tp} ({p.world_size} rank{'s' * (p.world_size > 1)}"
    layout += f", {strategy} TP)" if strategy and p.tp > 1 else ")"
    tokens = t.batch_size * t.grad_accum * p.dp * cfg.data.seq_len
    per_step = f"batch {t.batch_size} x {cfg.data.seq_len} x accum {t.grad_accum} x dp {p.dp}"
    return [
        f"{'resuming' if resume else 'training'} {arch} ({m.preset} preset, {size} parameters) "
        f"on {device.type}, {layout}, {t.dtype}",
        *(decisions or []),
        f"data {data}{source} (vocabulary {m.vocab_size}, {tokens:,} tokens a step: {per_step}), "
        f"{t.steps} steps, run dir {run_dir}",
        MEM_LEGEND,
    ]


def restart_note(cfg: RunConfig, joined: bool) -> str | None:
    """``parallel.max_restarts`` restarts only ranks boostlr starts itself: say so when a
    launcher started them instead (it would otherwise be ignored without a word)."""
    k = cfg.parallel.max_restarts
    if not (joined and k):
        return None
    return (
        f"boostlr: note: parallel.max_restarts {k} is not used: the launcher started the ranks "
        "(torchrun: --max-restarts; srun: resubmit or rerun the step with --resume, "
        "docs/cluster.md#one-node)"
    )


def announce(
    cfg: RunConfig,
    run_dir: Path,
    data: Path,
    device: torch.device,
    resume: bool,
    console: bool,
    joined: bool,
    decisions: list[str] | None = None,
) -> None:
    """Print the start-up lines (``console``) and any note about unused options (stderr)."""
    if console:
        lines = startup_lines(cfg, run_dir, data, device, resume, decisions)
        print("\n".join(lines), flush=True)
    note = restart_note(cfg, joined)
    if note:
        print(note, file=sys.stderr, flush=True)
