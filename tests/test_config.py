"""Config building: TOML, dotted overrides, resolution and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest

from boostlr.config import build_config, dump_toml, from_dict, parse_overrides, to_dict
from boostlr.errors import ConfigError


def test_defaults_resolve_from_preset() -> None:
    cfg = build_config()
    assert (cfg.model.arch, cfg.model.preset, cfg.model.dim, cfg.model.rank) == (
        "cola",
        "small",
        128,
        32,
    )


def test_toml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('[model]\narch = "svd"\npreset = "tiny"\n[train]\nsteps = 7\nlr = 0.01\n')
    cfg = build_config(path, parse_overrides(["--train.steps", "9", "--model.rank=8"]))
    assert cfg.model.arch == "svd" and cfg.train.steps == 9 and cfg.model.rank == 8
    assert cfg.train.lr == 0.01


def test_round_trip_through_toml() -> None:
    cfg = build_config(overrides=[("model.arch", "lax"), ("train.dtype", "bfloat16")])
    import tomllib

    again = from_dict(tomllib.loads(dump_toml(cfg)))
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([("model.bogus", "1")], "unknown config key 'model.bogus'"),
        ([("nosection.x", "1")], "unknown config key"),
        ([("train.steps", "ten")], "train.steps: expected int"),
        ([("train.steps", "1.5")], "train.steps: expected int"),
        ([("model.tie_embeddings", "maybe")], "expected bool"),
        ([("model.arch", "dense")], "model.arch 'dense' is not one of"),
        ([("model.preset", "9B")], "model.preset '9B' is unknown"),
        ([("model.n_heads", "5")], "does not divide model.dim"),
        ([("model.n_kv_heads", "3")], "does not divide model.n_heads"),
        ([("model.rank", "1000")], "exceeds min(d_in, d_out)"),
        ([("model.rank_ratio", "1.5")], "rank_ratio must be in (0, 1]"),
        ([("train.dtype", "float16")], "train.dtype 'float16' is not one of"),
        ([("train.batch_size", "0")], "train.batch_size must be >= 1"),
        ([("train.lr", "-1")], "train.lr must be > 0"),
        ([("data.seq_len", "99999")], "exceeds model.max_seq_len"),
        ([("model.arch", "full"), ("model.mlp", "lowrank-only")], "has no nonlinearity"),
        ([("parallel.device", "tpu")], "parallel.device 'tpu' is not one of"),
    ],
)
def test_bad_values_fail_with_one_line(overrides: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(overrides=overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\narch=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        build_config(flat)


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["steps"])


def test_a_removed_key_names_its_removal_and_old_runs_still_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'parallel.pair_exchange' was removed.*delete the key"):
        build_config(overrides=[("parallel.pair_exchange", "true")])
    old_run = tmp_path / "config.toml"
    old_run.write_text("[parallel]\ntp = 2\npair_exchange = true\n")
    with pytest.raises(ConfigError, match="was removed"):
        build_config(old_run)  # a config the user wrote
    assert build_config(old_run, saved=True).parallel.tp == 2  # a run's own: --resume
    assert from_dict({"parallel": {"pair_exchange": False, "tp": 2}}).parallel.tp == 2


def test_every_config_field_is_typed_and_has_a_docstring() -> None:
    """The schema documents itself: a docstring under every field, choices as ``Literal``."""
    import ast
    import dataclasses
    import typing

    from boostlr.config import schema

    tree = ast.parse(Path(schema.__file__).read_text())
    for cls in (schema.ModelConfig, schema.DataConfig, schema.TrainConfig, schema.ParallelConfig):
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = node.body
        documented = {
            stmt.target.id
            for stmt, after in zip(body, body[1:], strict=False)
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        }
        names = {f.name for f in dataclasses.fields(cls)}
        assert names - documented == set(), cls.__name__
    hints = typing.get_type_hints(schema.ParallelConfig)
    assert typing.get_args(hints["act_ckpt"]) == schema.ACT_CKPT_MODES
    assert typing.get_args(typing.get_type_hints(schema.ModelConfig)["arch"]) == schema.ARCHS
