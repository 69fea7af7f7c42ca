"""Name a rank that died by a signal, with the likely cause and the options that help.

The kernel's out-of-memory killer sends SIGKILL and leaves nothing in the rank's own output,
so the launcher is the only one who can say what happened. The peak it reports is the
largest resident set of any rank this process started (the kernel keeps it for reaped
children); the limit is the cgroup's, or the machine's memory.
"""

from __future__ import annotations

import resource
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from boostlr.config import RunConfig


def memory_limit_mb() -> float | None:
    """The memory this process may use: its cgroup's limit, else the machine's RAM."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            return int(limit) / 2**20
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def largest_child_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def memory_options(cfg: RunConfig) -> list[str]:
    """Overrides that lower a rank's memory at this layout, most effective first."""
    p, t = cfg.parallel, cfg.train
    options = []
    if p.act_ckpt == "none":
        options.append(
            "--parallel.act_ckpt lowrank" if cfg.model.lowrank else "--parallel.act_ckpt block"
        )
    if t.batch_size > 1:
        options.append(
            f"--train.batch_size {t.batch_size // 2} --train.grad_accum {2 * t.grad_accum}"
        )
    if p.dp > 1 and p.data_parallel_mode == "ddp":
        options.append("--parallel.dp_mode fsdp")
    if t.async_ckpt:
        options.append("--train.async_ckpt false")
    options.append("more ranks in --parallel.tp or --parallel.pp")
    return options


def killed_rank_messages(exc: ChildFailedError, cfg: RunConfig) -> list[str]:
    """One line per rank that died by a signal; ranks that exited with a code say why."""
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode >= 0:
            continue
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        line = f"rank {rank} was killed by {name}"
        if -failure.exitcode == signal.SIGKILL:
            limit = memory_limit_mb()
            of = f" of {limit:,.0f} MiB" if limit else ""
            line += (
                f" (likely out of memory: peak RSS {largest_child_rss_mb():,.0f} MiB{of} on "
                f"this machine); try {', or '.join(memory_options(cfg))}"
            )
        lines.append(line)
    return lines
