"""``boostlr plan``: the three strategies side by side, or the best layouts for N GPUs.

Configs are built exactly as ``boostlr train`` builds them (TOML, then ``--section.key``
overrides, then :func:`~boostlr.config.build_config`'s resolution and validation), so a row or
a proposal is always a config the trainer accepts. Impossible requests raise
:class:`~boostlr.errors.ConfigError` (one line, exit code 2).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass

from boostlr.analysis.costmodel import Prediction, planning_config, predict
from boostlr.analysis.dp_choice import choose_dp_mode, with_mode
from boostlr.analysis.hardware import HardwareProfile
from boostlr.config import (
    RunConfig,
    build_config,
    resolve_layout,
    resolve_model,
    set_value,
    validate,
)
from boostlr.errors import ConfigError
from boostlr.specs.arch import COLA, FULL, arch_spec
from boostlr.specs.moe import HIDDEN, LATENT
from boostlr.specs.schedule import DEFAULT_SCHEDULE, SCHEDULES
from boostlr.specs.strategy import act_ckpt_modes, strategies_for, strategy_spec

SEARCH_OVERRIDES = [  # --search replaces the layout; model, data and train stay
    ("parallel.tp", "1"),
    ("parallel.pp", "1"),
    ("parallel.dp", "-1"),
    ("parallel.tp_strategy", "auto"),
    ("parallel.act_ckpt", "none"),
    ("parallel.microbatches", "0"),
]


def load_config(
    file: str | None, pairs: list[tuple[str, str]], gpus: int | None, search: bool
) -> RunConfig:
    """The run config ``boostlr train`` would build; ``--gpus`` fills ``parallel.nproc``."""
    extra: list[tuple[str, str]] = []
    if search:
        if not gpus:
            raise ConfigError("--search needs --gpus N: the number of GPUs to lay out")
        extra = [*SEARCH_OVERRIDES, ("parallel.nproc", str(gpus))]
    elif gpus:
        extra = [("parallel.nproc", str(gpus))]
    return build_config(file, extra + pairs)


def variant(cfg: RunConfig, arch: str, strategy: str, act_ckpt: str) -> RunConfig:
    """``cfg`` with another arch (its rank and MLP re-resolved), strategy and ``act_ckpt``."""
    out = copy.deepcopy(cfg)
    m = out.model
    if arch != m.arch:
        m.arch = arch
        m.rank = None if arch_spec(arch).lowrank else m.rank
        m.mlp = "auto"
        resolve_model(m)
    out.parallel.tp_strategy = strategy
    out.parallel.act_ckpt = act_ckpt
    validate(out)
    return out


def strategy_rows(cfg: RunConfig, hw: HardwareProfile) -> list[Prediction]:
    """Dense ``full`` + ``megatron``, then the config's low-rank arch under vanilla and btp.

    Each row keeps the config's ``act_ckpt`` where it applies; ``lowrank`` (BTP regions only)
    becomes ``block`` for the two baselines, as in the paper-layout configs. An MoE config's
    rows are its dispatch forms instead (:func:`moe_rows`).
    """
    if cfg.model.moe_experts:
        return moe_rows(cfg, hw)
    ckpt = cfg.parallel.act_ckpt
    base = "block" if ckpt == "lowrank" else ckpt
    return [
        predict_as_trained(
            variant(cfg, a, s, ckpt if ckpt in strategy_spec(s).act_ckpt else base), hw
        )
        for a, s in families(cfg)
    ]


def predict_as_trained(cfg: RunConfig, hw: HardwareProfile) -> Prediction:
    """The prediction for ``cfg`` in the data-parallel mode the trainer would run it in
    (:func:`as_trained`); the row's layout then says which mode and why (``dp_mode_auto``)."""
    trained, reason = as_trained(cfg, hw)
    pred = predict(trained, hw)
    if reason:
        pred.layout["dp_mode_auto"] = reason
    return pred


def as_trained(cfg: RunConfig, hw: HardwareProfile) -> tuple[RunConfig, str]:
    """(``cfg`` with ``parallel.dp_mode auto`` decided as the trainer decides it on a device
    of ``hw``'s memory, the reason; ``""`` where the config or the layout decided).

    Under a pipeline with dp the trainer takes the plan's choice
    (:func:`~boostlr.analysis.dp_choice.choose_dp_mode`), so a row or a trace is the mode a
    run on that device takes, not the layout's default.
    """
    if cfg.parallel.dp_mode != "auto" or not cfg.parallel.dp_mode_by_plan:
        return cfg, ""
    choice = choose_dp_mode(cfg, hw.memory, hw, f"the {hw.name} profile")
    return with_mode(cfg, choice.mode), choice.reason


def moe_families(cfg: RunConfig) -> list[tuple[str, str]]:
    """(arch, dispatch) of an MoE config's rows, at its own layout and expert shape: dense
    experts (``full``, hidden), the low-rank arch's whole-MLP experts (hidden; not LaX,
    which routes only latents) and its latent experts (docs/moe.md, "Planning")."""
    lowrank = arch_spec(cfg.model.arch if cfg.model.lowrank else COLA.name)
    forms = [form for form in (HIDDEN, LATENT) if form.takes(lowrank)]
    return [(FULL.name, HIDDEN.name), *((lowrank.name, form.name) for form in forms)]


def moe_rows(cfg: RunConfig, hw: HardwareProfile) -> list[Prediction]:
    """One prediction per :func:`moe_families` row, each validated as the trainer would."""
    families = moe_families(cfg)
    if cfg.parallel.tp > 1:  # BTP runs the latent dispatch only (config/validate_moe.py)
        families = [(a, d) for a, d in families if d == LATENT.name]
    return [predict_as_trained(moe_variant(cfg, a, d), hw) for a, d in families]


def moe_variant(cfg: RunConfig, arch: str, dispatch: str) -> RunConfig:
    """``cfg`` with another arch (its rank re-resolved) and MoE dispatch form."""
    out = copy.deepcopy(cfg)
    m = out.model
    if arch != m.arch:
        m.arch = arch
        m.rank = None if arch_spec(arch).lowrank else m.rank
        m.mlp = "auto"
        resolve_model(m)
    m.moe_dispatch = dispatch
    if out.parallel.act_ckpt == "lowrank":  # BTP's regions: an MoE block checkpoints whole
        out.parallel.act_ckpt = "block"
    validate(out)
    return out


def expert_parallel_degrees(cfg: RunConfig, dp: int) -> list[int]:
    """The ``parallel.ep`` a search tries at ``dp``: divisors of dp that divide the routed
    experts (1 alone for a dense model)."""
    m = cfg.model
    if not m.moe_experts:
        return [1]
    return [e for e in _divisors(dp) if m.moe_experts % e == 0]


# ----------------------------------------------------------------------------- search


@dataclass
class Candidate:
    overrides: dict[str, str]
    prediction: Prediction


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(cfg: RunConfig, hw: HardwareProfile, gpus: int, top: int = 5) -> list[Candidate]:
    """Every valid layout of ``gpus`` GPUs that fits memory, fastest first.

    The global batch (sequences per optimizer step) and ``train.batch_size`` stay fixed;
    ``grad_accum`` follows from dp. TP stays inside a node.
    """
    found, tried = candidates(cfg, hw, gpus)
    if not found:
        m = cfg.model
        what = f"{m.preset} {m.arch}" + (f" (d {m.dim}, {m.n_layers} layers)" if m.dim else "")
        raise ConfigError(
            f"{what} does not fit any of the {tried} valid layouts of {gpus} x {hw.name} "
            f"({hw.memory / 1e9:.0f} GB each): use more GPUs, a smaller train.batch_size or "
            "data.seq_len, or a larger-memory profile"
        )
    return _distinct(found)[:top]


def candidates(cfg: RunConfig, hw: HardwareProfile, gpus: int) -> tuple[list[Candidate], int]:
    """(the layouts that fit, fastest first; how many valid layouts were tried)."""
    gpn = hw.gpus_per_node
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    if gpus > gpn and gpus % gpn:
        raise ConfigError(
            f"--gpus {gpus} is not a multiple of the {gpn} GPUs per node of {hw.name}: "
            "tensor- and data-parallel groups would straddle a partial node; use a multiple"
        )
    cfg = planning_config(cfg)  # the vocabulary once, not per candidate
    m, t = cfg.model, cfg.train
    global_batch = t.batch_size * t.grad_accum * cfg.parallel.dp
    takes = strategies_for(arch_spec(m.arch))
    tried = 0
    found: list[Candidate] = []
    for tp in (k for k in _divisors(gpus) if k <= gpn):
        for pp in (k for k in _divisors(gpus // tp) if k <= m.n_layers):
            dp = gpus // (tp * pp)
            if global_batch % (t.batch_size * dp):
                continue
            accum = global_batch // (t.batch_size * dp)
            micro = [0] if pp == 1 else sorted({k for k in _divisors(t.batch_size) if k >= pp})
            schedules = [DEFAULT_SCHEDULE.name] if pp == 1 else list(SCHEDULES)
            for mb, schedule in itertools.product(micro, schedules):
                strategies = [s.name for s in takes] if tp > 1 else ["auto"]
                # The vocabulary split over dp or held by FSDP: both, whatever auto would pick
                # (only under data parallelism with untied tables does it change anything).
                vocab_modes = ("true", "false") if dp > 1 and not m.tie_embeddings else ("auto",)
                for strategy in strategies:
                    ckpts = list(act_ckpt_modes(None if strategy == "auto" else strategy))
                    eps = expert_parallel_degrees(cfg, dp)
                    modes = itertools.product(ckpts, ("fsdp", "ddp"), vocab_modes, eps)
                    for ckpt, mode, vocab, ep in modes:
                        over = {
                            "parallel.tp": str(tp),
                            "parallel.pp": str(pp),
                            "parallel.dp": str(dp),
                            "parallel.nproc": str(gpus),
                            "parallel.tp_strategy": strategy,
                            "parallel.act_ckpt": ckpt,
                            "parallel.dp_mode": mode,
                            "parallel.vocab_dp": vocab,
                            "parallel.pp_schedule": schedule,
                            "parallel.microbatches": str(mb),
                            "train.grad_accum": str(accum),
                            "train.global_batch": "0",
                        }
                        if m.moe_experts:  # only an MoE config has the key to set
                            over["parallel.ep"] = str(ep)
                        try:
                            cand = apply(cfg, over)
                        except ConfigError:
                            continue
                        tried += 1
                        pred = predict(cand, hw)
                        if pred.fits:
                            found.append(Candidate(over, pred))
    found.sort(key=lambda c: c.prediction.step_time)
    return found, tried


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """Drop layouts whose prediction equals a faster one's (dp_mode at dp 1, say)."""
    seen: set[tuple] = set()
    out = []
    for c in cands:
        p = c.prediction
        key = (round(p.step_time, 9), round(p.memory_total), c.overrides["parallel.tp"])
        key += (c.overrides.get("parallel.ep"),)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _copy(cfg: RunConfig) -> RunConfig:
    """A copy of each section (every config field is a scalar: cheaper than a deepcopy)."""
    return RunConfig(
        model=dataclasses.replace(cfg.model),
        data=dataclasses.replace(cfg.data),
        train=dataclasses.replace(cfg.train),
        parallel=dataclasses.replace(cfg.parallel),
    )


def apply(cfg: RunConfig, overrides: dict[str, str]) -> RunConfig:
    """``cfg`` with the layout overrides, resolved and validated like the trainer's."""
    out = _copy(cfg)
    for key, value in overrides.items():
        set_value(out, key, value)
    resolve_layout(out)
    validate(out)
    return out


def families(cfg: RunConfig) -> list[tuple[str, str]]:
    """(arch, strategy) of the three lines: dense megatron, low-rank vanilla and btp."""
    lowrank = cfg.model.arch if cfg.model.lowrank else COLA.name
    dense = [(FULL.name, s.name) for s in strategies_for(FULL)]
    return dense + [(lowrank, s.name) for s in strategies_for(arch_spec(lowrank))]


def search_form(cfg: RunConfig, gpus: int, global_batch: int) -> RunConfig:
    """``cfg`` as ``--search --gpus`` builds it (layout reset), with a fixed global batch."""
    over = dict(SEARCH_OVERRIDES)
    over["parallel.nproc"] = str(gpus)
    over["train.global_batch"] = str(global_batch)
    return apply(cfg, over)


def best_layouts(cfg: RunConfig, hw: HardwareProfile, gpus: int) -> dict[str, Candidate | None]:
    """The fastest fitting layout of ``gpus`` GPUs per strategy line (None: nothing fits).

    ``cfg`` is in search form; one enumeration per arch serves both low-rank lines.
    """
    out: dict[str, Candidate | None] = {}
    by_arch: dict[str, list[Candidate]] = {}
    for arch, strategy in families(cfg):
        if arch not in by_arch:
            base = variant(cfg, arch, "auto", "none") if arch != cfg.model.arch else cfg
            by_arch[arch] = candidates(base, hw, gpus)[0]
        allowed = (None, strategy)
        out[strategy] = next((c for c in by_arch[arch] if c.prediction.strategy in allowed), None)
    return out


def with_preset(cfg: RunConfig, preset: str) -> RunConfig:
    """``cfg`` with another preset's shape (rank from ``rank_ratio``, the preset's vocab)."""
    shape = dict.fromkeys(("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rank"))
    model = dataclasses.replace(cfg.model, preset=preset, vocab_size=0, **shape)
    resolve_model(model)
    return dataclasses.replace(cfg, model=model)
