"""The mixture-of-experts keys' checks, and ``model.moe_dispatch auto`` decided.

Kept beside :mod:`boostlr.config.validate` (which calls :func:`validate_moe`) so the MoE rules
read as one list. Every failure is one :class:`~boostlr.errors.ConfigError` line naming the
key and the fix (exit code 2), raised before any work starts.
"""

from __future__ import annotations

import dataclasses

from boostlr.config.schema import (
    MOE_BALANCES,
    MOE_DISPATCHES,
    OMITTED_AT_DEFAULT,
    ModelConfig,
    ParallelConfig,
)
from boostlr.errors import ConfigError
from boostlr.specs.arch import LOWRANK_ARCHS, arch_spec
from boostlr.specs.moe import HIDDEN, LATENT, DispatchSpec, resolve_dispatch
from boostlr.specs.strategy import strategy_spec


def dispatch_of(m: ModelConfig) -> DispatchSpec:
    """The spec of ``model.moe_dispatch``, ``auto`` decided by the arch (the latent form for
    low-rank archs; ``full`` has no latent to route)."""
    return resolve_dispatch(m.moe_dispatch, arch_spec(m.arch))


def moe_dispatch_of(m: ModelConfig) -> str:
    """``model.moe_dispatch`` with ``auto`` decided (its name, as configs and exports write it)."""
    return dispatch_of(m).name


def validate_moe(m: ModelConfig, p: ParallelConfig | None = None, compile: bool = False) -> None:
    """Reject impossible MoE settings; ``p`` adds the layout checks (unset when only a model
    is loaded: checkpoints, exports), ``compile`` is ``train.compile``."""
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts must be >= 0 (0 = dense MLP), got {m.moe_experts}")
    if p is not None:
        _validate_ep(m, p, compile)
    if m.moe_experts == 0:
        _no_moe_keys(m)
        return
    for key, options in (("moe_dispatch", MOE_DISPATCHES), ("moe_balance", MOE_BALANCES)):
        value = getattr(m, key)
        if value not in options:
            raise ConfigError(f"model.{key} '{value}' is not one of: {', '.join(options)}")
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(
            f"model.moe_top_k {m.moe_top_k} must be in [1, model.moe_experts = "
            f"{m.moe_experts}]: lower --model.moe_top_k or add experts"
        )
    if m.moe_ffn_dim is None:
        raise ConfigError(
            "model.moe_ffn_dim is missing: MoE experts need their inner width (e.g. "
            "--model.moe_ffn_dim 256)"
        )
    if m.moe_ffn_dim < 1:
        raise ConfigError(f"model.moe_ffn_dim must be >= 1, got {m.moe_ffn_dim}")
    if m.moe_shared < 0:
        raise ConfigError(f"model.moe_shared must be >= 0, got {m.moe_shared}")
    if not 0 <= m.moe_dense_layers < m.n_layers:
        raise ConfigError(
            f"model.moe_dense_layers {m.moe_dense_layers} must be in [0, model.n_layers = "
            f"{m.n_layers}): at least the last block must be an MoE block (or set "
            "model.moe_experts 0)"
        )
    for key in ("moe_aux_coef", "moe_bias_rate", "moe_capacity"):
        if not getattr(m, key) >= 0:
            raise ConfigError(f"model.{key} must be >= 0, got {getattr(m, key)}")
    dispatch, arch = dispatch_of(m), arch_spec(m.arch)
    if not dispatch.takes(arch) and dispatch.shared_outer:
        raise ConfigError(
            f"model.moe_dispatch {dispatch.name} needs a low-rank arch "
            f"({', '.join(LOWRANK_ARCHS)}), not '{m.arch}': use --model.moe_dispatch "
            f"{HIDDEN.name}"
        )
    if not dispatch.takes(arch):
        raise ConfigError(
            f"model.moe_dispatch {dispatch.name} is not supported for arch {m.arch} (each "
            "whole-MLP expert would need its own crossing latents per token): use "
            f"--model.moe_dispatch {LATENT.name}"
        )
    if m.lowrank and m.rank is not None and m.rank > m.moe_ffn_dim:
        raise ConfigError(
            f"model.rank {m.rank} exceeds model.moe_ffn_dim {m.moe_ffn_dim}, the experts' "
            "inner width: lower model.rank or raise model.moe_ffn_dim"
        )
    if p is not None:
        _validate_tp(m, p, dispatch)
    if p is not None and p.act_ckpt == "lowrank":
        raise ConfigError(
            "parallel.act_ckpt lowrank checkpoints BTP's regions, which an MoE block does not "
            "run: use --parallel.act_ckpt block (or none) with model.moe_experts > 0"
        )


def _validate_tp(m: ModelConfig, p: ParallelConfig, dispatch: DispatchSpec) -> None:
    """Tensor parallelism: BTP with latent dispatch only (the router rides in its MLP norm's
    all-reduce and every TP rank holds the latents it routes: parallel/btp_moe.py)."""
    strategy = p.strategy_for(m.arch)
    if strategy is None:
        return
    if not strategy_spec(strategy).bottleneck_regions:
        raise ConfigError(
            f"model.moe_experts > 0 runs under tp strategy btp only, not '{strategy}' (even "
            "at parallel.tp 1): use a low-rank arch with --parallel.tp_strategy btp, or tp 1"
        )
    if not dispatch.shared_outer:
        raise ConfigError(
            f"model.moe_dispatch {dispatch.name} runs on the single-device block only, not "
            f"under tp strategy {strategy}: use --model.moe_dispatch {LATENT.name}, or tp 1 "
            "without a tp_strategy"
        )
    if p.tp > 1 and m.moe_capacity:
        raise ConfigError(
            f"model.moe_capacity ({m.moe_capacity}) is not supported with parallel.tp > 1 "
            "yet (each TP rank would drop over its own share): drop --model.moe_capacity"
        )


def _validate_ep(m: ModelConfig, p: ParallelConfig, compile: bool) -> None:
    """``parallel.ep``: a divisor of dp (ep ranks are carved out of it) and of the routed
    experts (each ep rank holds ``E / ep`` of them); its receive bound; under
    ``train.compile`` a capacity (fixed shapes), since dropless sizes are data-dependent."""
    if p.ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1 (1 = no expert parallelism), got {p.ep}")
    factor = p.ep_receive_factor
    if not (factor == 0 or factor >= 1):
        raise ConfigError(
            f"parallel.ep_receive_factor must be 0 (no bound) or >= 1 (the balanced load), got "
            f"{factor}: below 1 even balanced routing drops (use --model.moe_capacity)"
        )
    if p.ep == 1:
        return
    if m.moe_experts == 0:
        raise ConfigError(
            f"parallel.ep {p.ep} needs routed experts: set --model.moe_experts or drop "
            "--parallel.ep"
        )
    if p.dp >= 1 and p.dp % p.ep:
        raise ConfigError(
            f"parallel.ep {p.ep} must divide parallel.dp {p.dp}: expert-parallel ranks are "
            "carved out of the data-parallel ones"
        )
    if m.moe_experts % p.ep:
        raise ConfigError(
            f"parallel.ep {p.ep} must divide model.moe_experts {m.moe_experts}: each ep rank "
            "holds the same number of experts"
        )
    if compile and not m.moe_capacity:
        raise ConfigError(
            f"train.compile with parallel.ep {p.ep} needs a capacity: dropless all-to-all "
            "sizes change every micro-batch (a recompile each time): set --model.moe_capacity "
            "(e.g. 1.25) or --train.compile false"
        )


def refuse_moe(m: ModelConfig, what: str, missing: str) -> None:
    """One line naming what does not handle an MoE model yet, rather than a silent dense
    answer (a cost model without the experts, an export without its routers)."""
    if m.moe_experts > 0:
        raise ConfigError(
            f"{what} does not support MoE models yet (model.moe_experts {m.moe_experts}): "
            f"{missing} (docs/moe.md says what runs today)"
        )


def _no_moe_keys(m: ModelConfig) -> None:
    """A MoE key set while ``moe_experts`` is 0 would be silently ignored: say so instead."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for key in OMITTED_AT_DEFAULT["model"]:
        if key != "moe_experts" and getattr(m, key) != defaults[key]:
            raise ConfigError(
                f"model.{key} is set but model.moe_experts is 0 (dense MLP): set "
                "--model.moe_experts or drop the MoE keys"
            )
