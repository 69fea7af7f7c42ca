"""The trainer's rule for ``parallel.dp_mode auto`` under a pipeline: the plan's choice
(:mod:`boostlr.analysis.dp_choice`) on this device's memory.

The memory is a constant of the device's kind, the same on every rank of a job of one kind
of device (a rank never decides on what it measures, or ranks could build different
models and hang in their first collective):

* CUDA: the shipped profile matched by the card's name (its data-sheet memory), which also
  gives the predicted step times; a card without a profile: its total memory, the modes then
  ranked by the plan's dp bytes;
* CPU: the host's physical memory over the ranks on this node (they share it); the step
  times are the ``local`` profile's (``boostlr calibrate``) when there is one, else the
  modes are ranked by dp bytes.
"""

from __future__ import annotations

import os

import torch

from boostlr.analysis.dp_choice import DpModeChoice, choose_dp_mode
from boostlr.analysis.hardware import HardwareProfile, load_profile, user_dir
from boostlr.config import RunConfig
from boostlr.errors import ConfigError
from boostlr.platform import platform_for
from boostlr.train.perf import gpu_profile_name


def local_ranks(world: int) -> int:
    """Ranks sharing this node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) or
    ``SLURM_NTASKS_PER_NODE``, else every rank (boostlr's own launcher starts them here)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world)
    return world


def _profile(name: str | None) -> HardwareProfile | None:
    if name is None:
        return None
    try:
        return load_profile(name)
    except ConfigError:
        return None


def device_memory(device: torch.device, world: int) -> tuple[float, HardwareProfile | None, str]:
    """(bytes one rank's device has, the profile that times the modes or ``None``, where the
    bytes came from)."""
    platform = platform_for(device)
    accelerator = platform.accelerator_name(device)
    if accelerator is not None:
        name = gpu_profile_name(accelerator)
        hw = _profile(name)
        if hw is not None:
            return hw.memory, hw, f"the {name} profile"
        return platform.describe(device)[1], None, f"{accelerator}'s total"
    hw = _profile("local") if (user_dir() / "local.toml").is_file() else None
    ranks = local_ranks(world)
    ram = platform.describe(device)[1]
    return ram / ranks, hw, f"the host's memory over {ranks} local rank{'s' * (ranks > 1)}"


class PlanRule:
    """A :data:`~boostlr.config.resolve.DpModeRule` that keeps its decision for the start
    line (``choice``; ``None`` when the config did not leave the mode to it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.choice: DpModeChoice | None = None

    def __call__(self, cfg: RunConfig) -> str:
        memory, hw, source = device_memory(self.device, cfg.parallel.world_size)
        try:
            self.choice = choose_dp_mode(cfg, memory, hw, source)
        except ConfigError:  # a profile that cannot time this run (a calibration without
            # the run's dtype): the modes are ranked by dp bytes instead, as without one
            self.choice = choose_dp_mode(cfg, memory, None, source)
        return self.choice.mode

    def lines(self) -> list[str]:
        return [self.choice.line()] if self.choice is not None else []
