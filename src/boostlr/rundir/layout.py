"""File and directory names of a run directory and of a checkpoint (public contracts).

A name here is never renamed: runs written by an older boostlr must stay readable.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.toml"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"
MEMORY_DIR = "memory"
CHECKPOINTS_DIR = "checkpoints"

# Inside checkpoints/step_N/ (a torch.distributed.checkpoint directory plus our files).
META_FILE = "meta.json"
TRAINER_FILE = "trainer.json"
DCP_METADATA = ".metadata"
# An export's weights (boostlr export; checkpoints are DCP directories).
MODEL_FILE = "model.safetensors"

STEP_DIR = re.compile(r"^step_(\d+)$")
TEMP_PREFIX = ".tmp-step_"


def checkpoints_dir(run_dir: Path) -> Path:
    """``<run>/checkpoints``: where a run's ``step_N`` directories live."""
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def rng_file(rank: int) -> str:
    """One rank's RNG state in a checkpoint."""
    return f"rng_rank{rank}.safetensors"


def memory_phase_file(run_dir: Path, rank: int) -> Path:
    """``<run>/memory/rank<N>.json``: one rank's memory phases."""
    return Path(run_dir) / MEMORY_DIR / f"rank{rank}.json"
