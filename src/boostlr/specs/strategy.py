"""What each tensor-parallel strategy is: what it shards and what it can run.

The runtime modules (:mod:`boostlr.parallel.btp`, ``vanilla``, ``megatron``) implement these;
validation, the pipeline's boundary shapes, the planner and the plots read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.specs.arch import ArchSpec


@dataclass(frozen=True)
class StrategySpec:
    """One strategy's facts.

    ``residual_sharded``: the residual stream between blocks is ``d/tp`` wide on each rank
    (BTP), not replicated. ``splits_rank``: the low-rank latent ``r`` is split over tp
    (vanilla), so tp must divide it. ``act_ckpt``: the activation-checkpoint modes it runs.
    """

    name: str
    takes_lowrank: bool
    residual_sharded: bool = False
    splits_rank: bool = False
    act_ckpt: tuple[str, ...] = ("none", "block")

    def takes(self, arch: ArchSpec) -> bool:
        return arch.lowrank == self.takes_lowrank

    def residual_width(self, dim: int, tp: int) -> int:
        """Width of the residual stream (and the pipeline's stage boundary) on one rank."""
        return dim // tp if self.residual_sharded else dim


MEGATRON = StrategySpec("megatron", takes_lowrank=False)
VANILLA = StrategySpec("vanilla", takes_lowrank=True, splits_rank=True)
BTP = StrategySpec(
    "btp", takes_lowrank=True, residual_sharded=True, act_ckpt=("none", "lowrank", "block")
)

STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (MEGATRON, VANILLA, BTP)}


def strategy_spec(name: str) -> StrategySpec:
    """The spec of strategy ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown tp strategy {name!r}: one of {', '.join(STRATEGIES)}") from None


def default_strategy(arch: ArchSpec) -> StrategySpec:
    """The strategy ``parallel.tp_strategy auto`` picks under tp > 1."""
    return BTP if arch.lowrank else MEGATRON
