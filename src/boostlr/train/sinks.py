"""Optional copies of the metrics rows: TensorBoard event files and Weights & Biases.

``metrics.jsonl`` stays the source of truth; a sink receives every row :class:`MetricsLog`
writes (rank 0 only) and logs its numeric fields as scalars under the same names, at the
row's ``step``. The packages are optional extras, imported only when asked for; a missing
one is a one-line configuration error before the run starts. ``close(ok=False)`` says the run
ended by an exception (W&B then marks its run failed).
"""

from __future__ import annotations

import importlib
import math
import os
import secrets
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from boostlr.errors import ConfigError

if TYPE_CHECKING:
    from boostlr.config import RunConfig, TrainConfig

TB_DIR = "tb"
WANDB_ID_FILE = "wandb_id"


def new_run_id() -> str:
    """A W&B-style run id: 8 base-36 digits (``wandb.util.generate_id`` is gone from wandb)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class MetricsSink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self, ok: bool = True) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (booleans and the step itself are not curves)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def require_packages(train: TrainConfig) -> None:
    """Fail before any work when a requested logger's package is not installed."""
    needed = []
    if train.tensorboard:
        needed.append(("torch.utils.tensorboard", "train.tensorboard", "tensorboard", "tb"))
    if train.wandb:
        needed.append(("wandb", "train.wandb", "wandb", None))
    for module, key, package, extra in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            how = f"pip install {package}" + (f" (or boostlr[{extra}])" if extra else "")
            raise ConfigError(
                f"{key} needs the {package} package, which is not installed: {how}, or unset {key}"
            ) from None


class TensorBoardSink:
    """Event files in ``<run>/tb/``; the resolved config as text."""

    def __init__(self, log_dir: Path, config_toml: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run re-does the steps after its checkpoint: purge_step makes TensorBoard
        # drop the earlier attempt's events from there on, as metrics.jsonl is truncated.
        purge = start_step + 1 if start_step else None
        self._writer = SummaryWriter(str(log_dir), purge_step=purge)
        indented = "\n".join("    " + line for line in config_toml.splitlines())
        self._writer.add_text("config", indented, global_step=start_step)
        self._writer.flush()

    def write(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self, ok: bool = True) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per run directory (its id is kept in ``<run>/wandb_id`` for resumes).

    ``WANDB_MODE=offline`` (or ``disabled``) is honoured by wandb itself. Its files go to
    ``<run>/wandb/``, or to ``$WANDB_DIR/wandb/`` when that is set (read here, at each run:
    wandb itself reads its variables once per process). The rows of one step make one W&B
    history row.
    """

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any], quiet: bool = False):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = new_run_id()
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            name=run_dir.name,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            config=config,
            # --quiet: no banner or end-of-run summary either (WANDB_SILENT=true does the same).
            settings={"silent": True} if quiet else None,
        )

    def write(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        values = {k: v for k, v in scalars(row).items() if math.isfinite(v)}
        # W&B history only moves forward: after an online resume ``run.step`` is past the steps
        # W&B already holds, and wandb would drop re-done rows below it with a warning each.
        if isinstance(step, int) and values and step >= self._run.step:
            self._run.log(values, step=step)

    def close(self, ok: bool = True) -> None:
        self._run.finish(exit_code=0 if ok else 1)


def open_sinks(
    cfg: RunConfig, run_dir: Path, start_step: int, quiet: bool = False
) -> list[MetricsSink]:
    """The sinks ``cfg.train`` asks for (call on rank 0 only); ``quiet`` silences their output."""
    from boostlr.config import dump_toml, to_dict

    sinks: list[MetricsSink] = []
    if cfg.train.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TB_DIR, dump_toml(cfg), start_step))
    if cfg.train.wandb:
        sinks.append(WandbSink(cfg.train.wandb, run_dir, to_dict(cfg), quiet=quiet))
    return sinks
