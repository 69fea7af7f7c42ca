"""What the benchmarks share: the machine line, a trainer-built part, its step, interleaving.

A benchmark measures what users run, so every model here comes from the trainer's own
:meth:`ParallelModel.build` (meta device, per-parameter seeds, DTensor shards, FSDP when
``dp > 1``) and every step is the trainer's: forward/backward, the global loss, clipping by
the whole model's norm, the fused AdamW step. Rounds interleave the variants so the
machine's noise hits them alike; tables report medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import date
from typing import Any

import torch

from boostlr.analysis.hardware import HardwareProfile, load_profile, user_dir
from boostlr.config import RunConfig, build_config
from boostlr.errors import ConfigError
from boostlr.parallel.engine import ParallelModel
from boostlr.train.optim import build_optimizer, init_optimizer_state


def machine() -> str:
    """One line naming the machine a table was measured on."""
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (
        f"machine: {cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, "
        f"{platform.python_version()}; date {date.today().isoformat()}"
    )


def run_config(overrides: dict[str, Any]) -> RunConfig:
    """A validated config from ``section.key`` overrides (values as on the command line)."""
    return build_config(overrides=[(k, str(v)) for k, v in overrides.items()])


def bench_config(args: Any, arch: str, extra: dict[str, Any] | None = None) -> RunConfig:
    """The config a benchmark's ``--preset --seq-len --batch-size --vocab [--device]`` give
    for ``arch``, plus ``section.key`` ``extra`` overrides."""
    shape = {
        "model.preset": args.preset,
        "model.arch": arch,
        "model.vocab_size": args.vocab,
        "data.seq_len": args.seq_len,
        "train.batch_size": args.batch_size,
        "parallel.device": getattr(args, "device", "cpu"),
    }
    return run_config({**shape, **(extra or {})})


def random_batch(
    vocab: int, batch: int, seq: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


@dataclass
class Part:
    """This rank's part of a model, built and stepped exactly as ``boostlr train`` does."""

    cfg: RunConfig
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    device: torch.device

    @classmethod
    def build(cls, cfg: RunConfig, device: torch.device) -> Part:
        torch.manual_seed(cfg.train.seed)
        model = ParallelModel.build(cfg, device)
        optimizer = build_optimizer(model.parameters(), cfg.train)
        init_optimizer_state(optimizer)
        return cls(cfg, model, optimizer, device)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
        """One optimizer step on one micro-batch: (seconds, the global loss on the device)."""
        bf16 = self.cfg.train.dtype == "bfloat16"
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = self.model.forward_backward(inputs, targets)
        loss = self.model.global_mean(loss)
        self.model.reduce_expert_gradients()  # as the trainer's step (MoE: ep, BTP's tp sum)
        self.model.clip_gradients(self.cfg.train.grad_clip)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started, loss


def timed_step(part: Part, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one step between two barriers.

    The CPU time is this rank's own work, which other jobs on a busy machine do not inflate.
    """
    import torch.distributed as dist

    dist.barrier()
    started, cpu = time.perf_counter(), time.thread_time()
    part.step(inputs, targets)
    cpu = time.thread_time() - cpu
    dist.barrier()
    return time.perf_counter() - started, cpu


def interleave(
    labels: Sequence[str], run: Callable[[str], float], rounds: int, steps: int
) -> dict[str, list[float]]:
    """``steps`` calls of ``run(label)`` per label per round, the labels taking turns."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            times[label].extend(run(label) for _ in range(steps))
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def load_or_calibrate(name: str, threads: int) -> HardwareProfile:
    """The hardware profile ``name``; ``local`` is calibrated first when it does not exist."""
    try:
        return load_profile(name)
    except ConfigError:
        if name != "local":
            raise
        from boostlr.calibrate import calibrate

        print(f"no local profile in {user_dir()}: running boostlr calibrate --threads {threads}")
        path, _ = calibrate(threads=threads)
        print(f"wrote {path}")
        return load_profile("local")  # as written: what a later run will read
