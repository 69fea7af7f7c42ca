"""The step loop over a :class:`RunState`: batches, clipping, AdamW, metrics, eval, saves.

A step never waits for the device: the loss and the gradient norm stay device tensors, and
their conversion to Python, the finiteness check and any synchronisation happen on log
steps and before every checkpoint save (so a non-finite state is never saved). The CPU can
then queue step N+1 while the device still runs step N.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from boostlr.data.loader import ValidationSet
from boostlr.faults import crash_point
from boostlr.models.counting import flops_per_token
from boostlr.rundir.layout import METRICS_FILE
from boostlr.train.memory import MemoryPhases, memory_row
from boostlr.train.metrics import ConsoleProgress, MetricsLog
from boostlr.train.optim import set_lr
from boostlr.train.perf import build_times, peak_flops
from boostlr.train.profiling import StepProfiler
from boostlr.train.saving import save_in_loop
from boostlr.train.sinks import open_sinks
from boostlr.train.state import RunState
from boostlr.train.stopping import reason
from boostlr.train.window import Window

COMM_GROUPS = ("tp", "dp", "pp")  # ledger group names timed into comm_{group}_time_s
EP_GROUPS = ("ep", "dp_rep")  # at ep > 1: comm_ep_time_s; both kept out of compute_time_s


def metrics_row(
    state: RunState, step: int, lr: float, window: Window, phases: MemoryPhases
) -> dict[str, float | int]:
    """One ``metrics.jsonl`` step row: loss, speed, utilisation, traffic, time and memory."""
    cfg, model = state.cfg, state.model
    loss, grad_norm = window.check(state, step)
    step_time = window.seconds_per_step()
    window.take_comm(model.comms.ledger)
    groups = COMM_GROUPS + (EP_GROUPS if model.comms.ep.size > 1 else ())
    comm = {g: window.comm.get(g, 0.0) / window.steps for g in groups}
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.parallel.dp
    tokens_per_step *= cfg.data.seq_len
    flops_per_s = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step / step_time
    row: dict[str, float | int] = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_step / step_time,
        "step_time_s": step_time,
        "tokens": step * tokens_per_step,
        "flops_per_s": flops_per_s,
        **model.step_metrics(),
        **{f"comm_{g}_time_s": comm[g] for g in groups if g != "dp_rep"},
        # CUDA FSDP streams may overlap compute: never report negative compute.
        "compute_time_s": max(0.0, step_time - sum(comm.values())),
        **memory_row(state.model.parameters(), state.optimizer, state.device, phases),
    }
    peak = peak_flops(state.device, cfg.train.dtype)
    if peak:  # MFU: the job's model FLOP/s over the peak of all its devices
        row["mfu"] = flops_per_s / (peak * cfg.parallel.world_size)
    return row


def evaluate(
    state: RunState,
    window: Window,
    autocast: AbstractContextManager,
    phases: MemoryPhases,
    metrics: MetricsLog | None,
    progress: ConsoleProgress,
    step: int,
) -> float:
    """Validation loss (on every rank), logged by rank 0; its time is kept out of the window."""
    paused = time.perf_counter()
    window.take_comm(state.model.comms.ledger)
    crash_point("eval", state.rank, step)
    val_loss = state.model.evaluate(state.val_data, autocast)
    phases.mark("eval")
    state.model.comms.ledger.take_seconds()  # evaluation's collectives are not the step's
    window.excluded += time.perf_counter() - paused
    data = state.val_data
    dropped = data.dropped if isinstance(data, ValidationSet) else 0  # a list: all of it
    row = {"step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}
    if metrics is not None:
        metrics.write({**row, "val_dropped": dropped})
    note = f"  ({dropped} window(s) left out: no whole batch per dp rank)" if dropped else ""
    progress.print(f"step {step:>6}  val_loss {val_loss:.4f}  ppl {math.exp(val_loss):.1f}{note}")
    return val_loss


def run_steps(state: RunState, console: bool) -> tuple[float, float | None, str | None]:
    """Train from ``state.start_step`` to ``train.steps``; every rank runs it, rank 0 logs.

    Returns the last logged loss, the last validation loss and, when the ranks stopped
    early (:mod:`boostlr.train.stopping`), why: that step was logged and saved (synchronously,
    async saves too), and no evaluation ran.
    """
    cfg, model, optimizer = state.cfg, state.model, state.optimizer
    t, start = cfg.train, state.start_step
    phases = state.phases or MemoryPhases(state.device, None)
    bf16 = t.dtype == "bfloat16"
    autocast = torch.autocast(state.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    rank0 = state.rank == 0
    sinks = open_sinks(cfg, state.run_dir, start, quiet=not console) if rank0 else []
    metrics = MetricsLog(state.run_dir / METRICS_FILE, sinks) if rank0 else None
    progress = ConsoleProgress(t.steps, start, enabled=console and rank0)
    profiler = StepProfiler(t.profile_steps, state.run_dir, state.rank, state.device)
    if state.restart_attempt > 0:
        if metrics is not None:
            metrics.write({"event": "restart", "step": start, "attempt": state.restart_attempt})
        progress.print(f"restarted (attempt {state.restart_attempt}) at step {start}")
    elif start:
        progress.print(f"resumed {state.run_dir} at step {start}")
    loss_value, val_loss, finished, stopped = float("nan"), None, False, None
    window = Window(state.device, start + 1)
    try:
        for step in range(start + 1, t.steps + 1):
            profiler.before_step(step)
            model.comms.ledger.reset()
            lr = state.lr(step - 1)
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            last = step == t.steps
            logs = step % t.log_every == 0 or last or step == start + 1
            model.begin_step(logs)  # what a row reads is recorded on log steps only
            total = torch.zeros((), device=state.device)
            crash_point("forward", state.rank, step)  # a pipeline's warm-up starts here
            for _ in range(t.grad_accum):
                inputs, targets = next(state.loader)
                with autocast, torch.profiler.record_function("forward_backward"):
                    total += model.forward_backward(inputs, targets)
            phases.mark("forward/backward")
            loss = model.global_mean(total / t.grad_accum)
            model.reduce_expert_gradients()  # ep > 1: the experts' dp_rep all-reduce
            with torch.profiler.record_function("clip_gradients"):
                window.add(step, loss, model.clip_gradients(t.grad_clip))
            with torch.profiler.record_function("optimizer.step"):
                optimizer.step()
            model.after_optimizer_step()  # state that follows the step, alike on all ranks
            phases.mark("step")
            crash_point("step", state.rank, step)
            stop = state.stop.check(state.writer.save_seconds) if state.stop else 0
            logs = logs or bool(stop)
            row = None
            if logs:
                row = metrics_row(state, step, lr, window, phases)
                row.update(model.log_metrics())  # every rank: collectives inside
                if step == start + 1:
                    row.update(build_times(model.stages, state.writer.group))
                loss_value = float(row["loss"])
                if metrics is not None:
                    metrics.write(row)
                window = Window(state.device, step + 1)
            profiler.after_step(step)
            if stop and not last:  # a stop at the last step is the run's normal end
                save_in_loop(state, step, window, phases, metrics, row)
                state.writer.wait()  # published before the exit: synchronous, async too
                stopped = f"stopped at step {step} ({reason(stop)}): saved {state.writer.last_path}"
                break
            if step % t.eval_every == 0 or last:
                val_loss = evaluate(state, window, autocast, phases, metrics, progress, step)
            if step % t.ckpt_every == 0 or last:
                save_in_loop(state, step, window, phases, metrics, row)
            progress.update(step, row)
        finished = True
    finally:
        profiler.close()
        state.writer.close()  # a save still in flight is finished, not dropped
        progress.close()
        if metrics is not None:
            metrics.close(ok=finished)
    if stopped is None and val_loss is not None:
        progress.print(
            f"done: step {t.steps}, loss {loss_value:.4f}, val_loss {val_loss:.4f}, "
            f"run {state.run_dir}"
        )
    return loss_value, val_loss, stopped
