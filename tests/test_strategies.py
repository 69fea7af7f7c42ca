"""The runtime registry: every strategy spec has exactly one runtime, and every runtime
module registers against a spec."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import boostlr.parallel
from boostlr.parallel import btp, single
from boostlr.parallel.strategies import RUNTIMES, _register, runtime
from boostlr.specs.strategy import STRATEGIES, StrategySpec


def test_every_strategy_spec_has_exactly_one_runtime_and_back() -> None:
    assert set(RUNTIMES) == set(STRATEGIES)
    for name, module in RUNTIMES.items():
        assert module.SPEC is STRATEGIES[name]
        assert callable(module.block_forward) and callable(module.embed)
        assert callable(module.head_input) and module.MLP_KINDS
    # Vice versa: a module of parallel/ that names a spec is that spec's registered runtime.
    declaring = []
    for info in pkgutil.iter_modules(boostlr.parallel.__path__):
        module = importlib.import_module(f"boostlr.parallel.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, StrategySpec):
            declaring.append(spec.name)
            assert RUNTIMES[spec.name] is module
    assert sorted(declaring) == sorted(STRATEGIES)


def test_the_registry_refuses_two_runtimes_for_one_spec_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="two runtimes for tp strategy 'btp'"):
        _register((btp, btp))
    with pytest.raises(ValueError, match="names no strategy spec"):
        _register((single,))
    with pytest.raises(ValueError, match="no runtime for tp strategy 'nope'"):
        runtime("nope")
    assert runtime(None) is single and single.MLP_KINDS is None
