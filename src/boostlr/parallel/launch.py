"""Start ranks: in-process through torch's elastic launcher, or join torchrun/srun's.

``boostlr train --parallel.nproc N`` calls :func:`launch`, the machinery behind torchrun,
without a shell-out. When the process was itself started by torchrun (or srun with the
usual variables), :func:`under_launcher` is true and the ranks already exist.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from boostlr.errors import BoostlrError, ConfigError


def resolve_device(name: str) -> torch.device:
    """``parallel.device`` as a torch device, checked before any rank starts."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device cuda requested but no CUDA GPU is visible: use cpu")
    return torch.device(name)


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_env() -> None:
    """Map srun's variables to torch's when torchrun is not in the middle.

    Call before :func:`under_launcher`, so ``srun -n N boostlr train ...`` joins the N tasks
    instead of each launching its own ranks. The rendezvous defaults to the node srun was
    started from, port 29500; set MASTER_ADDR / MASTER_PORT to override.
    """
    if under_launcher() or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    os.environ.setdefault("MASTER_PORT", "29500")


def launch(
    nproc: int,
    entrypoint: Callable[..., Any],
    *args: Any,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks; returns each rank's result.

    When a rank dies, the agent stops the others and restarts all of them, up to
    ``max_restarts`` times (``TORCHELASTIC_RESTART_COUNT`` tells them which attempt it is).
    ``env`` is added to the ranks' environment (e.g. ``LD_PRELOAD``), not to this process's.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"boostlr-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    child_env = {"OMP_NUM_THREADS": str(threads), **(env or {})}
    saved = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)  # spawned children inherit it before importing torch
    # The ranks print their own errors (one line, or a traceback for a crash); the agent's
    # log would repeat each of them as a wall of text.
    agent_logs = [
        logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")
    ]
    saved_levels = [log.level for log in agent_logs]
    for log in agent_logs:
        log.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, entrypoint)(*args)
    finally:
        for log, level in zip(agent_logs, saved_levels, strict=True):
            log.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pin_cpu_cores() -> list[int] | None:
    """Bind this rank to its own slice of the cores it may run on; ``None`` if nothing to do.

    Local ranks otherwise share every core with each other's compute and gloo threads, so
    one rank's transfer can preempt the peer it is waiting for. Called before the process
    group exists, so gloo's threads inherit the binding. Left alone when there are fewer
    cores than local ranks, or when srun already binds each rank (``--cpu-bind``).
    """
    cores = sorted(os.sched_getaffinity(0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per = len(cores) // local_world
    srun_bound = os.environ.get("SLURM_CPU_BIND_TYPE", "none").strip(",") not in ("", "none")
    if local_world <= 1 or per < 1 or srun_bound:
        return None
    mine = cores[local_rank * per : (local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    return mine


def init_distributed(
    device: torch.device, expected_world: int, timeout_s: float = 600, pin_cores: bool = False
) -> None:
    """Join the default process group (gloo on CPU, NCCL on CUDA)."""
    adopt_slurm_env()
    world = int(os.environ["WORLD_SIZE"])
    if world != expected_world:
        raise BoostlrError(
            f"the launcher started {world} ranks but the config needs {expected_world} "
            f"(parallel.pp x dp x tp): start {expected_world} ranks, or change the degrees "
            "(--parallel.dp -1 fills the world)"
        )
    if pin_cores and device.type == "cpu":
        pin_cpu_cores()
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(world, timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank = int(os.environ["RANK"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _attempt_store(world: int, timeout: timedelta) -> dist.Store | None:
    """The elastic agent's store, under a prefix of its own for each restart attempt.

    After a restart the agent hands out the same store, still holding the dead attempt's
    keys: a rank that reads a peer's address before the peer has re-published it would
    connect to a dead process (seen as gloo's "connection refused" on every restart in
    which one rank starts late). ``None`` outside an elastic agent (env:// as usual).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"/boostlr/attempt_{attempt}", agent)
