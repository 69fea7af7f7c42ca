"""The config resolved once, from the data's facts, then frozen for every later stage.

Parsing and validation (:func:`~boostlr.config.build_config`) leave some values to what only
the data knows: ``model.vocab_size 0`` (the tokenizer's) and ``parallel.vocab_dp auto``
(a rule over the vocabulary). :func:`resolve` fills those, with the layout's own
(``parallel.dp -1``, ``train.global_batch``, ``parallel.dp_mode auto``: under a pipeline
the caller's rule, the trainer's being the plan's), validates the result, and returns a
frozen copy before any rank starts: a stage after it reads values that can no longer
change under it, and one that tries to write raises
:class:`dataclasses.FrozenInstanceError`. The copy holds the same fields, so what a run
directory and a checkpoint record of it is what they recorded before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from boostlr.config.schema import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from boostlr.config.validate import resolve_layout, resolve_model, validate
from boostlr.errors import ConfigError

_T = TypeVar("_T")

# Decides ``parallel.dp_mode auto`` under a pipeline from a config whose layout and
# vocabulary are resolved: ``fsdp`` or ``ddp``. It must read only inputs every rank has
# alike (the config, the device's kind), never a rank's own measurement.
DpModeRule = Callable[["RunConfig"], str]


class DataFacts(Protocol):
    """What resolution needs from the data: a dataset, or anything that knows its vocabulary
    (a preset when planning)."""

    @property
    def vocab_size(self) -> int: ...


class _Frozen:
    """Assigning or deleting a field of a sealed instance raises: the sections of a resolved
    config. ``dataclasses.replace`` still works and gives another frozen instance."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field '{name}': the config is resolved (config.resolve)"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(
            f"cannot delete field '{name}': the config is resolved (config.resolve)"
        )


class FrozenModelConfig(_Frozen, ModelConfig):
    """A resolved :class:`ModelConfig`."""


class FrozenDataConfig(_Frozen, DataConfig):
    """A resolved :class:`DataConfig`."""


class FrozenTrainConfig(_Frozen, TrainConfig):
    """A resolved :class:`TrainConfig`."""


class FrozenParallelConfig(_Frozen, ParallelConfig):
    """A resolved :class:`ParallelConfig`."""


class FrozenRunConfig(_Frozen, RunConfig):
    """A resolved :class:`RunConfig`: every section frozen too."""


_FROZEN: dict[type, type] = {
    ModelConfig: FrozenModelConfig,
    DataConfig: FrozenDataConfig,
    TrainConfig: FrozenTrainConfig,
    ParallelConfig: FrozenParallelConfig,
}


def _fields(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def _sections(cfg: RunConfig, kind: dict[type, type] | None = None) -> dict[str, Any]:
    """Each section of ``cfg`` copied, as its frozen class (``kind``) or its plain one."""
    out = {}
    for name, value in _fields(cfg).items():
        plain = next(base for base in _FROZEN if isinstance(value, base))
        cls = kind[plain] if kind is not None else plain
        out[name] = cls(**_fields(value))
    return out


def is_resolved(cfg: RunConfig) -> bool:
    """Whether ``cfg`` is a frozen, resolved config (:func:`resolve`'s or :func:`freeze`'s)."""
    return isinstance(cfg, FrozenRunConfig)


def freeze(cfg: RunConfig) -> RunConfig:
    """A frozen copy of a config that is already resolved (a run's own saved one, handed to
    the ranks); itself when frozen. Anything still left to resolution is a bug here, not a
    user's input, so it raises ``ValueError``."""
    if is_resolved(cfg):
        return cfg
    p, m = cfg.parallel, cfg.model
    unresolved = [
        key
        for key, left in (
            ("model.vocab_size", m.vocab_size < 1),
            ("model.rank", m.lowrank and m.rank is None),
            ("parallel.dp", p.dp < 1),
            ("parallel.dp_mode", p.dp_mode == "auto"),
            ("parallel.vocab_dp", not isinstance(p.vocab_dp, bool)),
        )
        if left
    ]
    if unresolved:
        raise ValueError(f"freeze: {', '.join(unresolved)} not resolved: call config.resolve")
    return FrozenRunConfig(**_sections(cfg, _FROZEN))


def thaw(cfg: RunConfig) -> RunConfig:
    """A plain (writable) copy of ``cfg``, frozen or not: for a stage that derives a variant
    (a planner's layout), never the run's own config."""
    return RunConfig(**_sections(cfg))


def bind_vocab(model: ModelConfig, data: DataFacts) -> None:
    """Take the vocabulary from the data unless the config sets a (large enough) one."""
    if model.vocab_size == 0:
        model.vocab_size = data.vocab_size
    elif model.vocab_size < data.vocab_size:
        raise ConfigError(
            f"model.vocab_size {model.vocab_size} is smaller than the dataset's tokenizer "
            f"({data.vocab_size}): leave model.vocab_size at 0 to take it from the data"
        )


def resolve(cfg: RunConfig, data: DataFacts, dp_mode: DpModeRule | None = None) -> RunConfig:
    """``cfg`` with everything left to the data or the layout decided, validated, and frozen.

    Run before any rank starts (and again by each rank an external launcher started, on the
    same inputs). ``cfg`` itself is not written: the result is a copy. Resolving a resolved
    config gives the same values, so a resumed run's saved config resolves to itself.
    ``dp_mode`` decides ``parallel.dp_mode auto`` under a pipeline (the trainer passes the
    plan's rule, :mod:`boostlr.train.dp_mode`); without one the layout's default
    (``ParallelConfig.data_parallel_mode``). Errors are the
    :class:`~boostlr.errors.ConfigError` lines validation gives.
    """
    out = thaw(cfg)
    resolve_model(out.model)
    bind_vocab(out.model, data)
    resolve_layout(out)  # parallel.dp -1, grad_accum, dp_mode auto off a pipeline, vocab_dp
    if out.parallel.dp_mode == "auto":
        chosen = dp_mode(out) if dp_mode is not None else out.parallel.data_parallel_mode
        out.parallel.dp_mode = chosen  # type: ignore[assignment]
    validate(out)
    return freeze(out)
