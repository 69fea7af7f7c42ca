"""The runtime of each tensor-parallel strategy, registered against its spec.

A runtime module (:mod:`~boostlr.parallel.btp`, :mod:`~boostlr.parallel.vanilla`,
:mod:`~boostlr.parallel.megatron`) names the :class:`~boostlr.specs.strategy.StrategySpec` it
implements (``SPEC``) and the MLP kinds its block runs (``MLP_KINDS``,
:mod:`boostlr.models.mlp`); :mod:`~boostlr.parallel.single` is the single-device runtime
(strategy ``None``, every MLP kind). A new strategy is its runtime module, its spec, and one
entry in :data:`_MODULES`; the registry refuses two runtimes for one spec, and a test that
the runtimes and the specs pair up one to one.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from boostlr.models.llama import Block, Latents, LlamaModel
from boostlr.parallel import btp, megatron, single, vanilla
from boostlr.parallel.context import TPContext
from boostlr.specs.strategy import StrategySpec


class Runtime(Protocol):
    """What :class:`~boostlr.parallel.tensor_parallel.TensorParallelModel` calls."""

    SPEC: StrategySpec | None
    MLP_KINDS: tuple[str, ...] | None  # None: every kind

    def embed(self, model: LlamaModel, tokens: Tensor, ctx: TPContext) -> Tensor: ...

    def head_input(self, model: LlamaModel, x: Tensor, ctx: TPContext) -> Tensor: ...

    def block_forward(
        self,
        block: Block,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        z_prev: Latents | None,
        ctx: TPContext,
    ) -> tuple[Tensor, Latents | None]: ...


_MODULES: tuple[Runtime, ...] = (megatron, vanilla, btp)  # type: ignore[assignment]


def _register(modules: tuple[Runtime, ...]) -> dict[str, Runtime]:
    table: dict[str, Runtime] = {}
    for module in modules:
        if module.SPEC is None:
            raise ValueError(f"runtime {module!r} names no strategy spec")
        name = module.SPEC.name
        if name in table:
            raise ValueError(f"two runtimes for tp strategy {name!r}: {table[name]!r}, {module!r}")
        table[name] = module
    return table


#: The runtime of each strategy, by its spec's name.
RUNTIMES: dict[str, Runtime] = _register(_MODULES)
SINGLE: Runtime = single  # type: ignore[assignment]


def runtime(strategy: str | None) -> Runtime:
    """The runtime of ``strategy`` (``None``: the single-device model)."""
    if strategy is None:
        return SINGLE
    try:
        return RUNTIMES[strategy]
    except KeyError:
        known = ", ".join(RUNTIMES)
        raise ValueError(f"no runtime for tp strategy {strategy!r}: one of {known}") from None


def runtime_for(strategy: str | None, model: LlamaModel) -> Runtime:
    """The runtime of ``strategy``, refusing (by name, when the model is built rather than in
    its first forward) a block whose MLP kind the runtime does not run."""
    found = runtime(strategy)
    if found.MLP_KINDS is None:
        return found
    for index, block in model.layers.items():
        mlp: nn.Module = block.mlp
        kind = getattr(mlp, "kind", type(mlp).__name__)
        if kind not in found.MLP_KINDS:
            kinds = ", ".join(repr(k) for k in found.MLP_KINDS)
            raise ValueError(
                f"tp strategy {strategy!r} runs {kinds} MLPs, not the {kind!r} MLP of layer {index}"
            )
    return found
