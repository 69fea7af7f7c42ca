"""The single-process training loop: data, model, AdamW, checkpoints, metrics.

Everything the run needs to continue bit-for-bit is in the checkpoint (weights, optimizer
moments, data position, RNG); the learning-rate schedule is a pure function of the step.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from boostlr.config import RunConfig, dump_toml, from_dict, to_dict
from boostlr.data import BatchLoader, TokenDataset, default_dataset, val_batches
from boostlr.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    BoostlrError,
    ConfigError,
    TrainingDiverged,
)
from boostlr.faults import crash_point
from boostlr.fsutil import write_text_atomic
from boostlr.models.counting import flops_per_token
from boostlr.parallel.compile import check_toolchain
from boostlr.parallel.engine import ParallelModel
from boostlr.parallel.launch import adopt_slurm_env, init_distributed, launch, under_launcher
from boostlr.train.checkpoint import (
    Checkpoint,
    CheckpointWriter,
    newest_checkpoint,
    read_checkpoint,
)
from boostlr.train.host_alloc import allocator_env, cache_host_memory
from boostlr.train.memory import MemoryPhases, held_tensor_mb
from boostlr.train.metrics import ConsoleProgress, MetricsLog, truncate_after
from boostlr.train.optim import (
    build_optimizer,
    init_optimizer_state,
    set_lr,
)
from boostlr.train.perf import peak_flops, peak_memory_mb
from boostlr.train.profiling import StepProfiler
from boostlr.train.resume import check_resume_config, pick_checkpoint
from boostlr.train.sinks import open_sinks
from boostlr.train.state import TOKENIZER_FILE, RunState, restore, save

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
COMM_GROUPS = ("tp", "dp", "pp")  # ledger group names timed into comm_{group}_time_s


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    loss: float
    val_loss: float | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device cuda requested but no CUDA GPU is visible: use cpu")
    return torch.device(name)


def open_datasets(cfg: RunConfig) -> tuple[TokenDataset, TokenDataset]:
    """Load (or, for the default corpus, prepare once) the train and val splits."""
    path = cfg.data.path or default_dataset(vocab_size=cfg.data.default_vocab)
    return TokenDataset(path, "train"), TokenDataset(path, "val")


def bind_vocab(cfg: RunConfig, dataset: TokenDataset) -> None:
    """Take the vocabulary from the tokenizer unless the config sets a (large enough) one."""
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = dataset.vocab_size
    elif cfg.model.vocab_size < dataset.vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the dataset's tokenizer "
            f"({dataset.vocab_size}): leave model.vocab_size at 0 to take it from the data"
        )


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, console: bool = True) -> TrainResult:
    """Run (or continue) training into ``run_dir``; see README for the run-directory contract.

    Everything that can be wrong with the input is checked here, before any rank starts and
    before the run directory is touched. Several ranks (or ``parallel.max_restarts``) then
    launch the ranks in process, or join the ones torchrun/srun started.
    """
    device = resolve_device(cfg.parallel.device)
    if cfg.train.compile:
        check_toolchain(device)
    datasets = open_datasets(cfg)
    bind_vocab(cfg, datasets[0])
    world = cfg.parallel.world_size
    adopt_slurm_env()
    if under_launcher():
        return _train_under_launcher(cfg, run_dir, resume, console, device, datasets)
    ckpt = _check_run_dir(cfg, run_dir, resume)
    _write_run_dir(cfg, run_dir, datasets[0])
    ckpt_path = str(ckpt.path) if ckpt else None
    if world == 1 and cfg.parallel.max_restarts == 0:
        return _train_rank(cfg, run_dir, ckpt_path, console, device, datasets)
    results = launch(
        world,
        _rank_entry,
        to_dict(cfg),
        str(run_dir),
        ckpt_path,
        console,
        max_restarts=cfg.parallel.max_restarts,
        env=allocator_env(cfg.train.cpu_alloc_cache, device.type),
    )
    return results[0]


def restart_attempt() -> int:
    """How many times the launcher has restarted this run's ranks (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _train_under_launcher(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    console: bool,
    device: torch.device,
    datasets: tuple[TokenDataset, TokenDataset],
) -> TrainResult:
    """Rank 0 checks the run directory (hashing each file once) and writes it; all follow."""
    init_distributed(
        device, cfg.parallel.world_size, cfg.parallel.timeout_s, cfg.parallel.pin_cores
    )
    launcher_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if dist.get_rank() == 0 and cfg.parallel.max_restarts > launcher_restarts:
        print(
            f"boostlr: warning: parallel.max_restarts {cfg.parallel.max_restarts} applies to "
            f"boostlr's own launcher; this launcher restarts {launcher_restarts} times "
            "(torchrun: pass --max-restarts)",
            file=sys.stderr,
            flush=True,
        )
    try:
        restarted = restart_attempt() > 0
        ckpt_path = _on_rank0(
            lambda: _checked_run_dir(cfg, run_dir, resume or restarted, restarted, datasets[0])
        )
        return _train_rank(cfg, run_dir, ckpt_path, console, device, datasets)
    finally:
        dist.destroy_process_group()


def _checked_run_dir(
    cfg: RunConfig, run_dir: Path, resume: bool, restarted: bool, dataset: TokenDataset
) -> str | None:
    ckpt = _check_run_dir(cfg, run_dir, resume, required=not restarted)
    _write_run_dir(cfg, run_dir, dataset)
    return str(ckpt.path) if ckpt else None


def _on_rank0(task: Callable[[], str | None]) -> str | None:
    """Run ``task`` on rank 0 and give every rank its result (or its one-line error)."""
    answer: list = [None, None]
    if dist.get_rank() == 0:
        try:
            answer = [task(), None]
        except BoostlrError as exc:
            answer = [None, str(exc)]
    dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise BoostlrError(answer[1])
    return answer[0]


def _rank_entry(cfg_dict: dict, run_dir: str, ckpt_path: str | None, console: bool) -> TrainResult:
    """One rank started by :func:`launch` (module level: it is pickled to the child).

    After an automatic restart the arguments are those of the first start: the ranks find
    the newest valid checkpoint themselves (rank 0 verifies it, once).
    """
    cfg = from_dict(cfg_dict)
    # DTensor logs a performance note for every checkpointed 2-D (dp x tp) shard.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = resolve_device(cfg.parallel.device)
    distributed = cfg.parallel.world_size > 1
    if distributed:
        init_distributed(
            device, cfg.parallel.world_size, cfg.parallel.timeout_s, cfg.parallel.pin_cores
        )
    rank = dist.get_rank() if distributed else 0
    try:
        if restart_attempt() > 0:

            def newest() -> str | None:
                ckpt = pick_checkpoint(Path(run_dir), required=False)
                return str(ckpt.path) if ckpt else None

            ckpt_path = _on_rank0(newest) if distributed else newest()
        return _train_rank(cfg, Path(run_dir), ckpt_path, console, device)
    except BoostlrError as exc:  # every rank reports its own error, once, in one line
        print(f"boostlr: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    except TrainingDiverged as exc:
        print(f"boostlr: rank {rank}: training diverged: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    except Exception as exc:
        if lost_peer(exc):  # the launcher names the rank that died and why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"boostlr: rank {rank}: lost a peer rank ({first})", file=sys.stderr, flush=True)
        else:
            trace = traceback.format_exc()
            print(f"boostlr: rank {rank} crashed:\n{trace}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    finally:
        if distributed:
            dist.destroy_process_group()


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer(exc: Exception) -> bool:
    """A collective failed because another rank went away (not this rank's own fault)."""
    return isinstance(exc, dist.DistNetworkError) or any(s in str(exc) for s in _PEER_GONE)


def _check_run_dir(
    cfg: RunConfig, run_dir: Path, resume: bool, required: bool = True
) -> Checkpoint | None:
    """Checks of the run directory before training; returns the checkpoint to resume from."""
    if resume:
        ckpt = pick_checkpoint(run_dir, required)
        if ckpt is not None:
            check_resume_config(ckpt, cfg)
        return ckpt
    if (run_dir / CONFIG_FILE).exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run: pass --resume to continue it "
            "or choose a new --run-dir"
        )
    return None


def _write_run_dir(cfg: RunConfig, run_dir: Path, dataset: TokenDataset) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / TOKENIZER_FILE).exists():
        shutil.copyfile(dataset.tokenizer_path, run_dir / TOKENIZER_FILE)
    write_text_atomic(run_dir / CONFIG_FILE, dump_toml(cfg))


def _train_rank(
    cfg: RunConfig,
    run_dir: Path,
    ckpt_path: str | None,
    console: bool,
    device: torch.device,
    datasets: tuple[TokenDataset, TokenDataset] | None = None,
) -> TrainResult:
    """Build this rank's part of the model, restore a checkpoint, run the loop."""
    torch.manual_seed(cfg.train.seed)
    allocator = "device"
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
        allocator = cache_host_memory() if cfg.train.cpu_alloc_cache else "glibc"
    rank = dist.get_rank() if dist.is_initialized() else 0
    phase_file = memory_phase_file(run_dir, rank, cfg.train.memory_phases)
    phases = MemoryPhases(device, phase_file, allocator)
    model = ParallelModel.build(cfg, device, phases.mark)
    train_ds, val_ds = datasets or open_datasets(cfg)
    dp = model.comms.dp
    t, seq = cfg.train, cfg.data.seq_len
    loader = BatchLoader(
        train_ds, t.batch_size, seq, t.seed, dp.rank, dp.size, grad_accum=t.grad_accum
    )
    # The validation set is layout-free: the first val_batches x global batch windows of the
    # split, in batch_size batches dealt round-robin to the data-parallel ranks.
    per_global = t.grad_accum * dp.size
    val_data = val_batches(val_ds, t.batch_size, seq, cfg.data.val_batches * per_global)
    val_data = val_data[dp.rank :: dp.size]
    # Fused AdamW on this rank's parameters: one kernel per step, DTensor shards included
    # (torch 2.13 propagates _fused_adamw_ through DTensor; checked against one device).
    optimizer = build_optimizer(model.parameters(), t)
    init_optimizer_state(optimizer)  # every parameter has state: checkpoints hold all keys
    phases.mark("optimizer state")
    writer = CheckpointWriter(
        run_dir / "checkpoints", rank, model.comms.ckpt_group, t.keep_checkpoints, t.async_ckpt
    )
    state = RunState(cfg, run_dir, model, optimizer, loader, val_data, device, writer, rank, phases)
    if ckpt_path is not None:
        # Verified before any rank started (or by rank 0); read it as it is.
        restore(state, read_checkpoint(Path(ckpt_path)))
    if rank == 0 and (ckpt_path is not None or restart_attempt() > 0):
        truncate_after(run_dir / METRICS_FILE, state.start_step)
    return _run(state, console)


def memory_phase_file(run_dir: Path, rank: int, enabled: bool) -> Path | None:
    """``<run>/memory/rank<N>.json`` when ``train.memory_phases`` is on."""
    if not enabled:
        return None
    (run_dir / "memory").mkdir(parents=True, exist_ok=True)
    return run_dir / "memory" / f"rank{rank}.json"


def memory_row(state: RunState, phases: MemoryPhases) -> dict[str, float]:
    """This rank's tensors, its peak, and its floor (tensors + start-up runtime), in MiB."""
    held = held_tensor_mb(state.model.parameters(), state.optimizer)
    phases.note_held(held)
    peak = max(peak_memory_mb(state.device), phases.peak_mb)
    return {**held, "peak_mem_mb": peak, "mem_floor_mb": sum(held.values()) + phases.runtime_mb}


def _run(state: RunState, console: bool) -> TrainResult:
    """The step loop; every rank runs it, rank 0 alone writes metrics."""
    cfg, model, optimizer, run_dir = state.cfg, state.model, state.optimizer, state.run_dir
    phases = state.phases or MemoryPhases(state.device, None)
    t, start_step = cfg.train, state.start_step
    tokens_per_step = t.batch_size * t.grad_accum * cfg.parallel.dp * cfg.data.seq_len
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    autocast = (
        torch.autocast(state.device.type, dtype=torch.bfloat16)
        if t.dtype == "bfloat16"
        else nullcontext()
    )
    ledger = model.comms.ledger
    # MFU: the job's model FLOP/s over the peak of all its devices (omitted when unknown).
    peak = peak_flops(state.device, t.dtype)
    job_peak = peak * cfg.parallel.world_size if peak else None
    sinks = open_sinks(cfg, run_dir, start_step, quiet=not console) if state.rank == 0 else []
    metrics = MetricsLog(run_dir / METRICS_FILE, sinks) if state.rank == 0 else None
    progress = ConsoleProgress(t.steps, start_step, enabled=console and state.rank == 0)
    profiler = StepProfiler(t.profile_steps, run_dir, state.rank, state.device)
    if restart_attempt() > 0:
        if metrics is not None:
            metrics.write({"event": "restart", "step": start_step, "attempt": restart_attempt()})
        progress.print(f"restarted (attempt {restart_attempt()}) at step {start_step}")
    elif start_step:
        progress.print(f"resumed {run_dir} at step {start_step}")
    loss_value, val_loss = float("nan"), None
    window_time, window_steps = 0.0, 0
    window_comm = dict.fromkeys(COMM_GROUPS, 0.0)
    finished = False
    try:
        for step in range(start_step + 1, t.steps + 1):
            profiler.before_step(step)
            started = time.perf_counter()
            ledger.reset()
            lr = state.lr(step - 1)
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=state.device)
            for _ in range(t.grad_accum):
                inputs, targets = next(state.loader)
                with autocast, torch.profiler.record_function("forward_backward"):
                    total += model.forward_backward(inputs, targets)
            phases.mark("forward/backward")
            loss_value = model.global_mean(total / t.grad_accum)
            with torch.profiler.record_function("clip_gradients"):
                grad_norm = model.clip_gradients(t.grad_clip)
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                state.writer.wait()
                kept = newest_checkpoint(run_dir / "checkpoints")
                kept = kept.path if kept else "none"
                raise TrainingDiverged(
                    f"loss {loss_value} / grad norm {grad_norm} at step {step} is not finite: "
                    f"stopped without saving (last good checkpoint: {kept}); lower --train.lr "
                    "or use --train.dtype float32, then --resume"
                )
            with torch.profiler.record_function("optimizer.step"):
                optimizer.step()
            phases.mark("step")
            crash_point("step", state.rank, step)
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            window_time += time.perf_counter() - started
            window_steps += 1
            blocked = ledger.seconds()
            for group in COMM_GROUPS:
                window_comm[group] += blocked.get(group, 0.0)

            row = None
            if step % t.log_every == 0 or step == t.steps or step == start_step + 1:
                step_time = window_time / window_steps
                comm = {g: window_comm[g] / window_steps for g in COMM_GROUPS}
                flops_per_s = flops_tok * tokens_per_step / step_time
                row = {
                    "step": step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time,
                    "tokens": step * tokens_per_step,
                    "flops_per_s": flops_per_s,
                    **model.step_metrics(),
                    **{f"comm_{g}_time_s": comm[g] for g in COMM_GROUPS},
                    # CUDA FSDP streams may overlap compute: never report negative compute.
                    "compute_time_s": max(0.0, step_time - sum(comm.values())),
                    **memory_row(state, phases),
                }
                if job_peak:
                    row["mfu"] = flops_per_s / job_peak
                if metrics is not None:
                    metrics.write(row)
                window_time, window_steps = 0.0, 0
                window_comm = dict.fromkeys(COMM_GROUPS, 0.0)
            profiler.after_step(step)
            if step % t.eval_every == 0 or step == t.steps:
                val_loss = model.evaluate(state.val_data, autocast)
                phases.mark("eval")
                if metrics is not None:
                    metrics.write(
                        {"step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}
                    )
                progress.print(
                    f"step {step:>6}  val_loss {val_loss:.4f}  ppl {math.exp(val_loss):.1f}"
                )
            if step % t.ckpt_every == 0 or step == t.steps:
                blocked = save(state, step)
                phases.mark("save")
                if metrics is not None:
                    metrics.write({"step": step, "ckpt_block_s": blocked, "async": t.async_ckpt})
            progress.update(step, row)
        finished = True
    finally:
        profiler.close()
        state.writer.close()  # a save still in flight is finished, not dropped
        progress.close()
        if metrics is not None:
            metrics.close(ok=finished)
    if val_loss is not None:
        progress.print(
            f"done: step {t.steps}, loss {loss_value:.4f}, val_loss {val_loss:.4f}, run {run_dir}"
        )
    return TrainResult(run_dir, t.steps, loss_value, val_loss)
