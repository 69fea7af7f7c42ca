"""``train()``: check the input, start or join the ranks, build each rank's state, run it.

Three ways in, one path through: called directly (one process, or ``parallel.nproc`` ranks
started here through torch's elastic launcher) or inside ranks that torchrun/srun started.
Everything that can be wrong with the input is checked before any rank starts or the run
directory is touched; the run directory is then checked and written once (by this process,
or by rank 0 under an external launcher), and every rank builds its part of the model and
enters the step loop of :mod:`boostlr.train.loop`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from boostlr.analysis.dp_choice import mode_held_bytes
from boostlr.config import RunConfig, freeze, from_dict, resolve, to_dict
from boostlr.data import BatchLoader, TokenDataset, default_dataset, val_batches
from boostlr.data.loader import split_validation
from boostlr.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    BoostlrError,
    DataError,
    TrainingDiverged,
)
from boostlr.parallel.compile import check_toolchain
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.launch import (
    adopt_slurm_env,
    init_distributed,
    launch,
    under_launcher,
)
from boostlr.platform import platform_for, resolve_device
from boostlr.rundir import layout
from boostlr.rundir.checkpoint import read_checkpoint
from boostlr.rundir.layout import METRICS_FILE, checkpoints_dir
from boostlr.rundir.payload import sharded
from boostlr.rundir.resume import prepare_run_dir
from boostlr.rundir.timeouts import (
    MIN_IO_BYTES_PER_S,
    CheckpointGroup,
    CollectiveTimeout,
    shard_bytes,
)
from boostlr.rundir.writer import CheckpointWriter
from boostlr.train.dp_mode import PlanRule
from boostlr.train.host_alloc import allocator_env, cache_host_memory, release_freed_pages
from boostlr.train.loop import run_steps
from boostlr.train.memory import MemoryPhases
from boostlr.train.metrics import truncate_after
from boostlr.train.optim import build_optimizer, init_optimizer_state
from boostlr.train.sinks import require_packages
from boostlr.train.state import RunState, restore
from boostlr.train.stopping import (
    StopCheck,
    deadline,
    forward_to_children,
    handling_signals,
    ignore_signals,
    process_start_time,
    reason,
    received,
    stop_group,
)
from boostlr.train.summary import announce

_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    loss: float
    val_loss: float | None
    stopped: str | None = None  # why the ranks saved and stopped early (exit code 75)


def open_datasets(cfg: RunConfig) -> tuple[TokenDataset, TokenDataset]:
    """Load (or, for the default corpus, prepare once) the train and val splits."""
    path = cfg.data.path or default_dataset(vocab_size=cfg.data.default_vocab)
    return TokenDataset(path, "train"), TokenDataset(path, "val")


def restart_attempt() -> int:
    """How many times the launcher has restarted this run's ranks (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, console: bool = True) -> TrainResult:
    """Run (or continue) training into ``run_dir`` (the run directory: docs/checkpoints.md).

    ``cfg`` is resolved against the data once, here, before any rank starts; every later
    stage reads that frozen copy (:func:`~boostlr.config.resolve`), ``cfg`` is not written.
    A ``train.save_on_signal`` signal is recorded from here on (data preparation included)
    and stops the run at the end of a step (:mod:`boostlr.train.stopping`).
    """
    with handling_signals(cfg.train.save_on_signal):
        return _train(cfg, run_dir, resume, console)


def _train(cfg: RunConfig, run_dir: Path, resume: bool, console: bool) -> TrainResult:
    started = process_start_time()  # train.time_limit counts from here
    require_packages(cfg.train)  # here, not in validate(): plan needs no tensorboard
    device = resolve_device(cfg.parallel.device)
    if cfg.train.compile:
        check_toolchain(device)
    datasets = open_datasets(cfg)
    dp_rule = PlanRule(device)  # dp_mode auto under a pipeline: the plan's choice
    cfg = resolve(cfg, datasets[0], dp_rule)
    adopt_slurm_env()
    if os.environ.get("RANK", "0") == "0":  # once: this process, or rank 0 of a launcher's
        joined = under_launcher()
        announce(cfg, run_dir, datasets[0].path, device, resume, console, joined, dp_rule.lines())
    if under_launcher():  # torchrun/srun started the ranks: join them
        return _rank_main(
            cfg, run_dir, console, device, resume=resume, datasets=datasets, started=started
        )
    platform_for(device).check_local_ranks(cfg.parallel.world_size)
    ckpt = prepare_run_dir(cfg, run_dir, resume, datasets[0])
    if received():  # during data preparation: nothing trained, nothing to save
        return TrainResult(
            run_dir, 0, float("nan"), None, f"stopped before training ({reason(received())})"
        )
    if cfg.parallel.world_size == 1 and cfg.parallel.max_restarts == 0:
        return _train_rank(cfg, run_dir, ckpt, console, device, datasets, started=started)
    forward_to_children(True)  # a signal to this launcher goes on to its ranks
    try:
        results = launch(
            cfg.parallel.world_size,
            _rank_entry,
            to_dict(cfg),
            str(run_dir),
            ckpt,
            console,
            started,
            max_restarts=cfg.parallel.max_restarts,
            env=allocator_env(cfg.train.cpu_alloc_cache, device.type),
            own_signals=cfg.train.save_on_signal,
        )
    finally:
        forward_to_children(False)
    return results[0]


def _rank_entry(
    cfg_dict: dict, run_dir: str, ckpt_path: str | None, console: bool, started: float
) -> TrainResult:
    """One rank started by :func:`launch` (module level: it is pickled to the child)."""
    cfg = freeze(from_dict(cfg_dict))  # resolved before the ranks started
    device = resolve_device(cfg.parallel.device)
    with handling_signals(cfg.train.save_on_signal):
        result = _rank_main(
            cfg,
            Path(run_dir),
            console,
            device,
            ckpt_path=ckpt_path,
            exit_on_error=True,
            started=started,
        )
    ignore_signals(cfg.train.save_on_signal)  # this rank only hands its result back now
    return result


def _rank_main(
    cfg: RunConfig,
    run_dir: Path,
    console: bool,
    device: torch.device,
    *,
    ckpt_path: str | None = None,
    resume: bool | None = None,
    datasets: tuple[TokenDataset, TokenDataset] | None = None,
    exit_on_error: bool = False,
    started: float | None = None,
) -> TrainResult:
    """Join the process group, find the checkpoint (all ranks, once), train, leave the group.

    ``resume`` is given under an external launcher: the ranks then verify the checkpoint
    together and rank 0 writes the run directory. After an automatic restart the ranks look
    for the newest checkpoint themselves. Ranks this process started report their own
    errors and exit with its code; a timed-out collective is one line under any launcher.
    """
    # DTensor logs a performance note for every checkpointed 2-D (dp x tp) shard.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    distributed = cfg.parallel.world_size > 1 or under_launcher()
    if distributed:
        p = cfg.parallel
        device = init_distributed(device, p.world_size, p.timeout_s, p.pin_cores)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    ckpt_group = CheckpointGroup(world)  # verification's, then the writer's (one gloo group)
    try:
        restarted = restart_attempt() > 0
        if resume is not None or restarted:
            dataset = datasets[0] if datasets else open_datasets(cfg)[0]
            again = bool(resume) or restarted
            ckpt_path = prepare_run_dir(
                cfg,
                run_dir,
                again,
                dataset,
                required=not restarted,
                rank=rank,
                world=world,
                group=ckpt_group,
            )
        return _train_rank(
            cfg, run_dir, ckpt_path, console, device, datasets, ckpt_group, started=started
        )
    except (BoostlrError, TrainingDiverged, Exception) as exc:
        # Under torchrun/srun a timed-out collective or a lost peer is one line too, not a
        # traceback from every rank; other errors go to the CLI (one line or a crash).
        if not exit_on_error and not (isinstance(exc, CollectiveTimeout) or lost_peer(exc)):
            raise
        _report(rank, exc)
    finally:
        if distributed:
            dist.destroy_process_group()


def _report(rank: int, exc: BaseException) -> None:
    """One line per rank (a traceback only for a crash of its own), then its exit code."""
    if isinstance(exc, BoostlrError):
        print(f"boostlr: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    if isinstance(exc, TrainingDiverged):
        print(f"boostlr: rank {rank}: training diverged: {exc}", file=sys.stderr, flush=True)
    elif isinstance(exc, CollectiveTimeout):
        print(f"boostlr: rank {rank}: {exc}", file=sys.stderr, flush=True)
    elif lost_peer(exc):  # the launcher names the rank that died and why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"boostlr: rank {rank}: lost a peer rank ({first})", file=sys.stderr, flush=True)
    else:
        trace = "".join(traceback.format_exception(exc))
        print(f"boostlr: rank {rank} crashed:\n{trace}", file=sys.stderr, flush=True)
    sys.exit(EXIT_FAILED)


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank went away (not this rank's own fault)."""
    return isinstance(exc, dist.DistNetworkError) or any(s in str(exc) for s in _PEER_GONE)


def memory_phase_file(run_dir: Path, rank: int, enabled: bool) -> Path | None:
    """``<run>/memory/rank<N>.json`` when ``train.memory_phases`` is on."""
    if not enabled:
        return None
    path = layout.memory_phase_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _train_rank(
    cfg: RunConfig,
    run_dir: Path,
    ckpt_path: str | None,
    console: bool,
    device: torch.device,
    datasets: tuple[TokenDataset, TokenDataset] | None = None,
    ckpt_group: CheckpointGroup | None = None,
    started: float | None = None,
) -> TrainResult:
    """Build this rank's part of the model, restore a checkpoint, run the loop.

    ``cfg`` is the resolved config (frozen here when a caller resolved a plain one). Saves
    and loads run on ``ckpt_group``'s group (verification's, when it made one), sized here.
    ``started`` is when ``train.time_limit`` counts from (now, when not given).
    """
    cfg = freeze(cfg)
    torch.manual_seed(cfg.train.seed)
    allocator = "device"
    if platform_for(device).is_host:
        torch.use_deterministic_algorithms(True, warn_only=True)
        allocator = cache_host_memory() if cfg.train.cpu_alloc_cache else "glibc"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ckpt_group is None:
        ckpt_group = CheckpointGroup(dist.get_world_size() if dist.is_initialized() else 1)
    phase_file = memory_phase_file(run_dir, rank, cfg.train.memory_phases)
    with MemoryPhases(device, phase_file, allocator) as phases:
        model = ParallelModel.build(cfg, device, phases.mark)
        train_ds, val_ds = datasets or open_datasets(cfg)
        dp, t, seq = model.comms.dp, cfg.train, cfg.data.seq_len
        loader = BatchLoader(
            train_ds, t.batch_size, seq, t.seed, dp.rank, dp.size, t.grad_accum, device
        )
        # The validation set: the first val_batches x global batch windows of the split, in
        # batch_size batches dealt round-robin to the data-parallel ranks. Every rank evaluates
        # as many batches of the same shape (collectives over dp: FSDP's gathers, the
        # vocabulary split's); the windows that do not fill that are counted, not evaluated.
        per_global = t.grad_accum * dp.size
        val_data = val_batches(val_ds, t.batch_size, seq, cfg.data.val_batches * per_global, device)
        val_data, usable = split_validation(val_data, t.batch_size, dp.size, dp.rank)
        if usable == 0:
            raise DataError(
                f"the validation split has fewer whole batches of {t.batch_size} x {seq} "
                f"tokens than the {dp.size} data-parallel ranks: prepare more validation "
                "data (--val-fraction), or lower --train.batch_size or --data.seq_len"
            )
        # Fused AdamW on this rank's parameters: one kernel per step, DTensor shards included.
        optimizer = build_optimizer(model.parameters(), t)
        init_optimizer_state(optimizer)  # every parameter has state: checkpoints hold all keys
        phases.mark("optimizer state")
        # Saves and loads wait on the checkpoint group as long as the largest rank's shards
        # take to move at the slowest assumed rate, like verification (rundir/timeouts.py).
        shards = sharded(model.named_parameters(), optimizer)
        ckpt_group.size_to(shards, cfg.parallel.timeout_s)
        release_freed_pages()  # the build's transients; the allocator keeps the step's pages
        writer = CheckpointWriter.on_group(
            checkpoints_dir(run_dir), rank, ckpt_group, t.keep_checkpoints, t.async_ckpt, device
        )
        phases.mode_held = mode_held_bytes(cfg, model.comms.pp.rank, model.comms.tp.rank)
        state = RunState(
            cfg, run_dir, model, optimizer, loader, val_data, device, writer, rank, phases
        )
        state.restart_attempt = restart_attempt()
        # Until a save is measured, one is assumed to move the shards at the slowest rate.
        writer.estimate_s = shard_bytes(shards) / MIN_IO_BYTES_PER_S
        # SLURM's end time is asked once (rank 0); the stop flag's MAX tells the others.
        limit = t.time_limit if rank == 0 or t.time_limit.strip().lower() != "auto" else "none"
        end = deadline(limit, time.time() if started is None else started, os.environ)
        state.stop = StopCheck(stop_group(cfg.parallel.timeout_s), end)
        if ckpt_path is not None:
            # Verified before any rank started (or by rank 0); read it as it is.
            restore(state, read_checkpoint(Path(ckpt_path)))
        if rank == 0:  # a resume (or a restart before any save) re-does the later steps
            truncate_after(run_dir / METRICS_FILE, state.start_step)
        try:
            loss, val_loss, stopped = run_steps(state, console)
        finally:
            state.stop.close()
        return TrainResult(run_dir, t.steps, loss, val_loss, stopped)
