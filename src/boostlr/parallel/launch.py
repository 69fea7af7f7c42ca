"""Start ranks: in-process through torch's elastic launcher, or join torchrun/srun's.

``boostlr train --parallel.nproc N`` calls :func:`launch`, the machinery behind torchrun,
without a shell-out. When the process was itself started by torchrun (or srun with the
usual variables), :func:`under_launcher` is true and the ranks already exist.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from boostlr.errors import BoostlrError
from boostlr.platform import platform_for


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# MASTER_PORT under SLURM: SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN, i.e. 15000-31999:
# unprivileged, below Linux's ephemeral range (32768+) where outgoing connections take
# their ports, and different for jobs that share a node unless their ids are 17000 apart.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 17000
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def adopt_slurm_env() -> None:
    """Map srun's variables to torch's when torchrun is not in the middle.

    Call before :func:`under_launcher`, so ``srun -n N boostlr train ...`` joins the N tasks
    instead of each launching its own ranks. The rendezvous defaults to the first host of
    the step's (else the job's) node list, where srun puts task 0, on a port derived from
    the job id (:func:`slurm_port`); MASTER_ADDR / MASTER_PORT in the environment win.
    """
    if under_launcher() or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = slurm_master_addr(os.environ)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(slurm_port(os.environ.get("SLURM_JOB_ID")))


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """The first host of the node list srun gives (expanded here: no ``scontrol``)."""
    for var in _NODELIST_VARS:
        if env.get(var):
            try:
                return expand_nodelist(env[var])[0]
            except ValueError as exc:
                raise BoostlrError(
                    f"cannot read {var}={env[var]!r} ({exc}): set MASTER_ADDR to the host of rank 0"
                ) from None
    return "127.0.0.1"


def slurm_port(job_id: str | None) -> int:
    """A rendezvous port for a SLURM job: stable for the job, spread over jobs (29500
    without a job id, torch's default)."""
    digits = "".join(c for c in job_id or "" if c.isdigit())
    if not digits:
        return 29500
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order.

    ``nid[001234-001237,001240]``, ``a[1-3],b5``, ``gpu-[01-04]-ib``, ``n[1,3-5]x[2-3]``:
    hosts are separated by commas outside brackets; each ``[...]`` holds numbers and
    ranges (zero padding kept, as the low end of the range writes it), and several groups
    in one name expand to every combination, the leftmost group slowest.
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        hosts += _expand_name(name)
    if not hosts:
        raise ValueError("no host in the list")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for c in text:
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    if depth:
        raise ValueError("'[' without ']'")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str) -> list[str]:
    """One host expression (literal text and bracket groups) as its host names."""
    out = [""]
    rest = name
    while rest:
        if rest[0] == "[":
            end = rest.index("]")
            choices = _expand_group(rest[1:end])
            out = [prefix + choice for prefix in out for choice in choices]
            rest = rest[end + 1 :]
        else:
            end = rest.find("[")
            end = len(rest) if end < 0 else end
            out = [prefix + rest[:end] for prefix in out]
            rest = rest[end:]
    return out


def _expand_group(group: str) -> list[str]:
    """``001234-001237,001240`` -> the numbers as written (width of each low end kept)."""
    values = []
    for item in group.split(","):
        low, sep, high = item.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def launch(
    nproc: int,
    entrypoint: Callable[..., Any],
    *args: Any,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    own_signals: str = "",
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks; returns each rank's result.

    When a rank dies, the agent stops the others and restarts all of them, up to
    ``max_restarts`` times (``TORCHELASTIC_RESTART_COUNT`` tells them which attempt it is).
    ``env`` is added to the ranks' environment (e.g. ``LD_PRELOAD``), not to this process's.
    The agent leaves ``own_signals`` (``train.save_on_signal``) to the caller's handlers
    (which pass them on to the ranks, who save and return): by default it would stop the
    ranks on a SIGTERM and kill them 30 s later.
    """
    mine = {f"SIG{n.strip().upper().removeprefix('SIG')}" for n in own_signals.split(",")}
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
        **_agent_signals(mine),
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


_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the agent's default


def _agent_signals(leave: set[str]) -> dict[str, str]:
    """The LaunchConfig field that makes the agent handle its default signals but ``leave``
    (torch versions without it handle their defaults, read from the environment)."""
    wanted = ",".join(s for s in _AGENT_SIGNALS if s not in leave)
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {"signals_to_handle": wanted}
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = wanted
    return {}


def world_mismatch(world: int, expected: int, env: Mapping[str, str]) -> str:
    """Why the launcher's world is not the config's, and what to start instead.

    Under srun (SLURM's variables, no torchrun in between) every rank is an srun task and
    ``--parallel.nproc`` starts none: ``boostlr train --parallel.nproc 8`` typed into a batch
    script of one task joins that one task's world. Say so, in SLURM's words."""
    fix = "or change the degrees (--parallel.dp -1 fills the world)"
    if "SLURM_NTASKS" in env and "TORCHELASTIC_RUN_ID" not in env:
        return (
            f"SLURM started {world} task{'s' * (world != 1)} (SLURM_NTASKS={env['SLURM_NTASKS']})"
            f" but the config needs {expected} ranks (parallel.pp x dp x tp): under SLURM each "
            "rank is an srun task and --parallel.nproc starts none; inside the allocation run "
            f"`srun --ntasks {expected} boostlr train ...` (one task per GPU: sbatch "
            f"--ntasks-per-node GPUS, docs/cluster.md), {fix}"
        )
    return (
        f"the launcher started {world} ranks but the config needs {expected} "
        f"(parallel.pp x dp x tp): start {expected} ranks, {fix}"
    )


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
) -> torch.device:
    """Join the default process group (gloo on CPU, NCCL on CUDA); this rank's device.

    On CUDA the rank drives ``cuda:(LOCAL_RANK % visible GPUs)`` and the group is created
    bound to it (:mod:`boostlr.platform`).
    """
    adopt_slurm_env()
    world = int(os.environ["WORLD_SIZE"])
    if world != expected_world:
        raise BoostlrError(world_mismatch(world, expected_world, os.environ))
    platform = platform_for(device)
    if pin_cores and platform.is_host:
        pin_cpu_cores()
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = platform.bind_rank(device, os.environ)
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(world, timeout)
    kwargs = platform.process_group_kwargs(device)
    if store is None:
        dist.init_process_group(timeout=timeout, **kwargs)
    else:
        rank = int(os.environ["RANK"])
        dist.init_process_group(store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return device


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
