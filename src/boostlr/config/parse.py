"""A config from defaults, a TOML file and ``--section.key value`` overrides, and back.

The fully resolved result is written to the run directory as ``config.toml`` so a run can be
reproduced or resumed from it alone.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any

from boostlr._toml_write import dumps
from boostlr.config.schema import OMITTED_AT_DEFAULT, SECTIONS, ModelConfig, RunConfig
from boostlr.config.validate import resolve_layout, resolve_model, validate, validate_model
from boostlr.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations (cached: ``get_type_hints`` dominates a plan's layout search)."""
    return typing.get_type_hints(cls)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:  # one of a fixed set: validation names the choices
        return _coerce(value, str, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        options = [a for a in args if a is not type(None)]
        # A fixed word besides the type (``bool | Literal["auto"]``): the word as itself.
        words = [w for a in options if typing.get_origin(a) is typing.Literal for w in a.__args__]
        plain = [a for a in options if typing.get_origin(a) is not typing.Literal]
        if isinstance(value, str) and value.lower() in words:
            return value.lower()
        if type(None) in args:
            if isinstance(value, str) and value.lower() in ("none", "null"):
                return None
            if value is None:
                return None
        if words:
            try:
                return _coerce(value, plain[0], key)
            except ConfigError:
                name = plain[0].__name__
                choices = " or ".join(repr(w) for w in words)
                raise ConfigError(f"{key}: expected {name} or {choices}, got {value!r}") from None
        return _coerce(value, options[0], key)
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if annotation is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{key}: expected {name}, got {value!r}") from None
    raise ConfigError(f"{key}: unsupported field type {annotation}")  # pragma: no cover


# Keys that existed once: a config that sets one gets an error naming the removal; a run's
# own saved config (resume, checkpoints) drops it, so old runs continue.
REMOVED_KEYS = {
    "parallel.pair_exchange": (
        "was removed: tensor-parallel collectives use the backend's own (gloo/NCCL); delete the key"
    ),
}


def set_value(cfg: RunConfig, dotted: str, value: Any, saved: bool = False) -> None:
    if dotted in REMOVED_KEYS:
        if saved:
            return
        raise ConfigError(f"config key '{dotted}' {REMOVED_KEYS[dotted]}")
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name:
        raise ConfigError(
            f"unknown config key '{dotted}': keys look like section.name with section in "
            f"{', '.join(SECTIONS)}"
        )
    target = getattr(cfg, section)
    types_ = _field_types(type(target))
    if name not in types_:
        known = ", ".join(sorted(types_))
        raise ConfigError(f"unknown config key '{dotted}' (known {section} keys: {known})")
    setattr(target, name, _coerce(value, types_[name], dotted))


def apply_mapping(cfg: RunConfig, data: dict[str, Any], source: str, saved: bool = False) -> None:
    """Apply a nested ``{section: {key: value}}`` mapping (a parsed TOML file).

    ``saved``: the mapping is a run's own config, written by an earlier release.
    """
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: top-level key '{section}' must be a [section] table")
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value, saved)


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass an existing .toml file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--model.arch', 'cola', '--train.steps=5']`` into key/value pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument '{arg}': overrides look like --section.key VALUE"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value: write {arg} VALUE")
            value = args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def build_config(
    file: str | Path | None = None,
    overrides: list[tuple[str, str]] | None = None,
    saved: bool = False,
) -> RunConfig:
    """Defaults, then the TOML file, then overrides; resolved and validated.

    ``saved``: the file is a run's own ``config.toml`` (``--resume``).
    """
    cfg = RunConfig()
    if file is not None:
        apply_mapping(cfg, load_toml(file), str(file), saved)
    for key, value in overrides or []:
        set_value(cfg, key, value)
    resolve_model(cfg.model)
    resolve_layout(cfg)
    validate(cfg)
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict; ``None`` values are dropped because TOML cannot hold them."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        values = dataclasses.asdict(getattr(cfg, section))
        at_default = _omitted_defaults(section)
        out[section] = {
            k: v
            for k, v in values.items()
            if v is not None and (k not in at_default or at_default[k] != v)
        }
    return out


@functools.cache
def _omitted_defaults(section: str) -> dict[str, Any]:
    """The defaults of ``section``'s keys that are saved only when changed."""
    cls = type(getattr(RunConfig(), section))
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {k: defaults[k] for k in OMITTED_AT_DEFAULT.get(section, ())}


def dump_toml(cfg: RunConfig) -> str:
    return dumps(to_dict(cfg))


def from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    apply_mapping(cfg, data, "saved config", saved=True)
    return cfg


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    model = ModelConfig()
    types_ = _field_types(ModelConfig)
    for key, value in data.items():
        if key not in types_:
            raise ConfigError(f"saved model config has unknown key '{key}'")
        setattr(model, key, _coerce(value, types_[key], f"model.{key}"))
    resolve_model(model)
    validate_model(model)
    return model
