"""The single-process training loop: data, model, AdamW, checkpoints, metrics.

Everything the run needs to continue bit-for-bit is in the checkpoint (weights, optimizer
moments, data position, RNG); the learning-rate schedule is a pure function of the step.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
import traceback
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
    CheckpointError,
    ConfigError,
    TrainingDiverged,
)
from boostlr.fsutil import write_text_atomic
from boostlr.models.counting import flops_per_token
from boostlr.models.llama import build_model
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.launch import adopt_slurm_env, init_distributed, launch, under_launcher
from boostlr.parallel.tensor_parallel import (
    TensorParallelModel,
    clip_gradients,
    full_optimizer_state,
    load_full_optimizer_state,
)
from boostlr.train.checkpoint import (
    Checkpoint,
    load_model_state,
    load_trainer_state,
    newest_checkpoint,
    newest_verified_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from boostlr.train.metrics import ConsoleProgress, MetricsLog, truncate_after
from boostlr.train.optim import build_optimizer, lr_at, set_lr

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"


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
    before the run directory is touched. ``parallel.tp > 1`` then launches the ranks in
    process (or joins the ones torchrun/srun started).
    """
    device = resolve_device(cfg.parallel.device)
    datasets = open_datasets(cfg)
    bind_vocab(cfg, datasets[0])
    world = cfg.parallel.world_size
    adopt_slurm_env()
    if under_launcher():
        return _train_under_launcher(cfg, run_dir, resume, console, device, datasets)
    ckpt = _check_run_dir(cfg, run_dir, resume)
    _write_run_dir(cfg, run_dir, datasets[0])
    ckpt_path = str(ckpt.path) if ckpt else None
    if world == 1:
        return _train_rank(cfg, run_dir, ckpt_path, console, device, datasets)
    results = launch(world, _rank_entry, to_dict(cfg), str(run_dir), ckpt_path, console)
    return results[0]


def _train_under_launcher(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    console: bool,
    device: torch.device,
    datasets: tuple[TokenDataset, TokenDataset],
) -> TrainResult:
    """Every rank checks (read-only), then rank 0 writes the run directory."""
    init_distributed(device, cfg.parallel.world_size)
    try:
        ckpt = _check_run_dir(cfg, run_dir, resume)
        dist.barrier()
        if dist.get_rank() == 0:
            _write_run_dir(cfg, run_dir, datasets[0])
        dist.barrier()
        ckpt_path = str(ckpt.path) if ckpt else None
        return _train_rank(cfg, run_dir, ckpt_path, console, device, datasets)
    finally:
        dist.destroy_process_group()


def _rank_entry(cfg_dict: dict, run_dir: str, ckpt_path: str | None, console: bool) -> TrainResult:
    """One rank started by :func:`launch` (module level: it is pickled to the child)."""
    cfg = from_dict(cfg_dict)
    device = resolve_device(cfg.parallel.device)
    init_distributed(device, cfg.parallel.world_size)
    rank = dist.get_rank()
    try:
        return _train_rank(cfg, Path(run_dir), ckpt_path, console, device)
    except BoostlrError as exc:  # every rank reports its own error, once, in one line
        print(f"boostlr: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    except TrainingDiverged as exc:
        print(f"boostlr: rank {rank}: training diverged: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    except Exception:
        print(
            f"boostlr: rank {rank} crashed:\n{traceback.format_exc()}", file=sys.stderr, flush=True
        )
        sys.exit(EXIT_FAILED)
    finally:
        dist.destroy_process_group()


def _report(message: str) -> None:
    """One write per message, so lines from concurrent ranks do not interleave."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _check_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> Checkpoint | None:
    """Read-only checks of the run directory; returns the checkpoint to resume from."""
    if resume:
        ckpt, corrupted = newest_verified_checkpoint(run_dir / "checkpoints")
        for path in corrupted:
            print(f"boostlr: warning: skipping corrupted checkpoint {path}", file=sys.stderr)
        if ckpt is None:
            raise CheckpointError(
                f"--resume: {run_dir} has no complete checkpoint: start a fresh run without "
                "--resume (or point --run-dir at the run to continue)"
            )
        saved_model = ckpt.meta.get("config", {}).get("model")
        if saved_model != to_dict(cfg)["model"]:
            raise CheckpointError(
                f"--resume: the model config differs from the one saved in {ckpt.path}: "
                "drop the --model.* overrides when resuming"
            )
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
    """Build this rank's shard of the model and run the loop (opening the data if needed)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    ledger = CommLedger()
    comm = GroupComm(group, "tp", ledger)
    misc = GroupComm(group, "tp_misc", ledger)  # grad-norm statistics: not model traffic

    train_ds, val_ds = datasets or open_datasets(cfg)
    loader = BatchLoader(train_ds, cfg.train.batch_size, cfg.data.seq_len, seed=cfg.train.seed)
    val_data = val_batches(val_ds, cfg.train.batch_size, cfg.data.seq_len, cfg.data.val_batches)
    torch.manual_seed(cfg.train.seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)

    full = build_model(cfg.model, seed=cfg.train.seed, device="cpu")
    # Verified by the caller before any rank started; read it as it is.
    ckpt = read_checkpoint(Path(ckpt_path)) if ckpt_path else None
    if ckpt is not None:
        _load_weights(ckpt, full)
    p = cfg.parallel
    ctx = TPContext(comm, cfg.model, norm=p.norm, grouping=p.grouping, act_ckpt=p.act_ckpt)
    model = TensorParallelModel(full, p.strategy_for(cfg.model.arch), ctx).to(device)
    optimizer = build_optimizer(model, cfg.train)
    start_step = 0
    if ckpt is not None:
        trainer = load_trainer_state(ckpt)
        load_full_optimizer_state(model, optimizer, trainer["optimizer"])
        loader.load_state_dict(trainer["loader"])
        torch.set_rng_state(trainer["rng"]["cpu"])
        if torch.cuda.is_available() and trainer["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
        start_step = ckpt.step
        if rank == 0:
            truncate_after(run_dir / METRICS_FILE, start_step)
    return _run(
        cfg, run_dir, model, optimizer, loader, val_data, device, start_step, misc, rank, console
    )


def _load_weights(ckpt: Checkpoint, model) -> None:
    state = load_model_state(ckpt)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_only = missing == ["lm_head.weight"] and model.cfg.tie_embeddings
    if unexpected or (missing and not tied_only):
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): resume with the run's own config"
        )


def _run(
    cfg: RunConfig,
    run_dir: Path,
    model: TensorParallelModel,
    optimizer: torch.optim.Optimizer,
    loader: BatchLoader,
    val_data: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    start_step: int,
    misc: GroupComm,
    rank: int,
    console: bool,
) -> TrainResult:
    """The step loop; every rank runs it, rank 0 alone writes metrics and checkpoints."""
    t = cfg.train
    tokens_per_step = t.batch_size * t.grad_accum * cfg.data.seq_len
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if t.dtype == "bfloat16"
        else nullcontext()
    )
    ledger = model.ctx.comm.ledger
    metrics = MetricsLog(run_dir / METRICS_FILE) if rank == 0 else None
    progress = ConsoleProgress(t.steps, start_step, enabled=console and rank == 0)
    if start_step:
        progress.print(f"resumed {run_dir} at step {start_step}")
    last_ckpt: Path | None = None
    loss_value, val_loss = float("nan"), None
    window_time, window_steps = 0.0, 0
    try:
        for step in range(start_step + 1, t.steps + 1):
            started = time.perf_counter()
            ledger.reset()
            lr = lr_at(step - 1, t)
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            for _ in range(t.grad_accum):
                inputs, targets = (x.to(device) for x in next(loader))
                with autocast:
                    loss = model(inputs, targets)
                (loss / t.grad_accum).backward()
                total += loss.detach()
            loss_value = total.item() / t.grad_accum
            grad_norm = clip_gradients(model, t.grad_clip, misc)
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                kept = str(last_ckpt or newest_checkpoint(run_dir / "checkpoints") or "none")
                raise TrainingDiverged(
                    f"loss {loss_value} / grad norm {grad_norm} at step {step} is not finite: "
                    f"stopped without saving (last good checkpoint: {kept}); lower --train.lr "
                    "or use --train.dtype float32, then --resume"
                )
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            window_time += time.perf_counter() - started
            window_steps += 1

            row = None
            if step % t.log_every == 0 or step == t.steps or step == start_step + 1:
                step_time = window_time / window_steps
                row = {
                    "step": step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time,
                    "tokens": step * tokens_per_step,
                    "flops_per_s": flops_tok * tokens_per_step / step_time,
                    **ledger.step_metrics("comm_tp", group="tp"),
                }
                if metrics is not None:
                    metrics.write(row)
                window_time, window_steps = 0.0, 0
            if step % t.eval_every == 0 or step == t.steps:
                val_loss = evaluate(model, val_data, device, autocast)
                if metrics is not None:
                    metrics.write(
                        {"step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}
                    )
                progress.print(
                    f"step {step:>6}  val_loss {val_loss:.4f}  ppl {math.exp(val_loss):.1f}"
                )
            if step % t.ckpt_every == 0 or step == t.steps:
                last_ckpt = _save(cfg, run_dir, step, model, optimizer, loader, rank)
            progress.update(step, row)
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    if val_loss is not None:
        progress.print(
            f"done: step {t.steps}, loss {loss_value:.4f}, val_loss {val_loss:.4f}, run {run_dir}"
        )
    return TrainResult(run_dir, t.steps, loss_value, val_loss)


@torch.no_grad()
def evaluate(
    model: TensorParallelModel,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast,
) -> float:
    model.eval()
    losses = []
    for inputs, targets in batches:
        with autocast:
            losses.append(model(inputs.to(device), targets.to(device)).float().item())
    model.train()
    return sum(losses) / len(losses)


def _save(
    cfg: RunConfig,
    run_dir: Path,
    step: int,
    model: TensorParallelModel,
    optimizer: torch.optim.Optimizer,
    loader: BatchLoader,
    rank: int,
) -> Path | None:
    """Gather full-shape weights and optimizer state (every rank), rank 0 writes them.

    The files are identical whatever the TP layout, so export and resume need not know it.
    Tied embeddings store ``embed_tokens`` once (safetensors refuses shared storage).
    """
    state = model.full_state_dict()
    optim_state = full_optimizer_state(model, optimizer)
    if rank != 0:
        return None
    trainer = {
        "optimizer": optim_state,
        "loader": loader.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
    }
    return save_checkpoint(
        run_dir / "checkpoints",
        step,
        state,
        trainer,
        meta={"config": to_dict(cfg)},
        extra_files={TOKENIZER_FILE: run_dir / TOKENIZER_FILE},
        keep=cfg.train.keep_checkpoints,
    )
