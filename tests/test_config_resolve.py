"""The config is resolved once from the data's facts, then frozen: nothing writes to it after.

Also the mesh by dim name: every caller reaches a dim's group through one mapping, and the
dims are named and sized in one place (``parallel.mesh.mesh_shape``).
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train import tiny_run_config

from boostlr.config import (
    build_config,
    dump_toml,
    freeze,
    is_resolved,
    resolve,
    resolve_vocab_dp,
    thaw,
    to_dict,
)
from boostlr.errors import ConfigError
from boostlr.parallel.mesh import MESH_DIMS, mesh_coordinates, mesh_shape, single_process_comms
from boostlr.train import run as trainer

VOCAB = SimpleNamespace(vocab_size=512)  # a dataset's one fact resolution reads


def _config(**overrides: str):
    pairs = {"parallel.dp": "2", "train.batch_size": "4", "data.seq_len": "32", **overrides}
    return build_config(overrides=list(pairs.items()))


def test_resolve_fills_what_the_data_decides_and_leaves_its_input_alone() -> None:
    cfg = _config()
    assert cfg.model.vocab_size == 0 and cfg.parallel.vocab_dp == "auto"
    resolved = resolve(cfg, VOCAB)
    assert resolved.model.vocab_size == 512
    assert resolved.parallel.vocab_dp is True  # 2 x 4 x 32 tokens <= 1.5 x 512
    assert resolved.parallel.dp_mode == "fsdp"
    assert cfg.model.vocab_size == 0 and cfg.parallel.vocab_dp == "auto"  # a copy
    assert is_resolved(resolved) and not is_resolved(cfg)


def test_what_a_run_records_is_what_the_trainer_recorded_before() -> None:
    # The trainer used to write the vocabulary into the parsed config, then resolve vocab_dp.
    cfg, before = _config(), _config()
    before.model.vocab_size = VOCAB.vocab_size
    resolve_vocab_dp(before)
    resolved = resolve(cfg, VOCAB)
    assert dump_toml(resolved) == dump_toml(before)
    assert to_dict(resolved) == to_dict(before)
    again = resolve(build_config(overrides=[]), VOCAB)  # a resumed run's saved config
    assert to_dict(resolve(again, VOCAB)) == to_dict(again)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("model", "vocab_size", 1024),
        ("parallel", "vocab_dp", False),
        ("parallel", "dp", 4),
        ("train", "grad_accum", 2),
        ("data", "seq_len", 64),
    ],
)
def test_assigning_a_field_of_a_resolved_config_raises(section: str, key: str, value) -> None:
    resolved = resolve(_config(), VOCAB)
    part = getattr(resolved, section)
    before = getattr(part, key)
    with pytest.raises(dataclasses.FrozenInstanceError, match="the config is resolved"):
        setattr(part, key, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(part, key)
    assert getattr(part, key) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(resolved, section, thaw(resolved).model)


def test_a_resolved_config_stays_frozen_through_copies_and_pickles() -> None:
    resolved = resolve(_config(), VOCAB)
    derived = dataclasses.replace(resolved.model, n_layers=2)
    assert derived.n_layers == 2 and resolved.model.n_layers == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        derived.n_layers = 8
    back = pickle.loads(pickle.dumps(resolved))
    assert to_dict(back) == to_dict(resolved)
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.train.steps = 1
    plain = thaw(resolved)
    plain.train.steps = 1  # a writable copy for a planner's variant
    assert resolved.train.steps != 1 and plain.model.lowrank == resolved.model.lowrank


def test_freeze_refuses_a_config_left_unresolved() -> None:
    with pytest.raises(ValueError, match="model.vocab_size, parallel.vocab_dp not resolved"):
        freeze(_config())
    resolved = resolve(_config(), VOCAB)
    assert freeze(resolved) is resolved
    assert is_resolved(freeze(thaw(resolved)))


def test_resolution_errors_are_the_validation_lines() -> None:
    small = _config(**{"model.vocab_size": "100"})
    with pytest.raises(ConfigError, match="model.vocab_size 100 is smaller than the dataset's"):
        resolve(small, VOCAB)
    # Validation runs on the resolved values (a config built around the checks is refused).
    odd = thaw(resolve(_config(), VOCAB))
    odd.train.batch_size = 0
    with pytest.raises(ConfigError, match="train.batch_size must be >= 1, got 0"):
        resolve(odd, VOCAB)


def test_the_trainer_runs_on_the_frozen_config(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {}

    def no_steps(state, console):
        seen["cfg"], seen["model_cfg"] = state.cfg, state.model.cfg
        return 0.0, None, None  # (loss, val_loss, why the ranks stopped early)

    monkeypatch.setattr(trainer, "run_steps", no_steps)
    cfg = tiny_run_config(small_dataset)
    trainer.train(cfg, tmp_path / "run", console=False)
    assert cfg.model.vocab_size == 0  # the caller's config is not written
    assert seen["cfg"] is seen["model_cfg"] and is_resolved(seen["cfg"])
    assert seen["cfg"].model.vocab_size == 512
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen["cfg"].model.vocab_size = 0
    saved = build_config(tmp_path / "run" / "config.toml", saved=True)
    assert to_dict(saved) == to_dict(seen["cfg"])


def test_the_mesh_dims_are_named_in_one_place() -> None:
    cfg = _config(**{"parallel.pp": "2", "parallel.tp": "2"})
    assert mesh_shape(cfg.parallel) == {"pp": 2, "dp": 2, "tp": 2}
    assert MESH_DIMS == ("pp", "dp", "tp")
    p = cfg.parallel
    for rank in range(p.world_size):  # tp fastest, pp outermost
        at = mesh_coordinates(p, rank)
        assert at == {"pp": rank // (p.dp * p.tp), "dp": (rank // p.tp) % p.dp, "tp": rank % p.tp}
    comms = single_process_comms()
    assert set(comms.groups) == set(MESH_DIMS)
    for dim in MESH_DIMS:
        assert comms.group(dim) is getattr(comms, dim) and comms.group(dim).size == 1
    with pytest.raises(KeyError, match="the mesh has no dim 'ep'"):
        comms.group("ep")
    with pytest.raises(TypeError):
        comms.groups["ep"] = comms.dp  # type: ignore[index]
