"""Per-rank bodies for the 3D tests: build a layout, run a step, compare with one device."""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from fp32_noise import float64_grads, relative_error
from torch.distributed.tensor import DTensor

from boostlr.config import RunConfig, build_config, resolve_vocab_dp
from boostlr.models.llama import build_model
from boostlr.models.placement import VOCAB_PARAMS, chunk_range
from boostlr.parallel.engine import ParallelModel

VOCAB = 101
SEQ = 8

# DTensor logs a performance note for every 2-D full_tensor() the checks make.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def layout_config(arch: str, strategy: str, pp: int, dp: int, tp: int, **extra) -> RunConfig:
    overrides = {
        "model.preset": "tiny",
        "model.arch": arch,
        "model.n_layers": 4 if pp > 1 else 2,
        "data.seq_len": SEQ,
        "train.batch_size": 4,
        "parallel.pp": pp,
        "parallel.dp": dp,
        "parallel.tp": tp,
        "parallel.tp_strategy": strategy,
        **extra,
    }
    cfg = build_config(overrides=[(k, str(v)) for k, v in overrides.items()])
    cfg.model.vocab_size = VOCAB
    resolve_vocab_dp(cfg)  # as the trainer does once the tokenizer gives the vocabulary
    return cfg


def global_batch(cfg: RunConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rows = cfg.train.batch_size * cfg.parallel.dp
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def full_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def full_value(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def compare_one_step(rank: int, world: int, cfg: RunConfig) -> dict:
    """Loss and every gradient of this rank's stages against the single-device model."""
    device = torch.device("cpu")
    model = ParallelModel.build(cfg, device)
    inputs, targets = global_batch(cfg)
    b = cfg.train.batch_size
    dp_rank = model.comms.dp.rank
    mine = slice(dp_rank * b, (dp_rank + 1) * b)
    loss = float(model.global_mean(model.forward_backward(inputs[mine], targets[mine])))

    ref = build_model(cfg.model, seed=cfg.train.seed)
    ref_loss = ref(inputs, targets)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    worst_w, worst_g = 0.0, 0.0
    for name, p in model.named_parameters():
        r = ref_params[name]
        worst_w = max(worst_w, (full_value(p) - r.detach()).abs().max().item())
        g = full_grad(p)
        err = (g - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-12)
        worst_g = max(worst_g, err.item())
    return {
        "loss": loss,
        "ref_loss": ref_loss.item(),
        "worst_weight_diff": worst_w,
        "worst_grad_error": worst_g,
        "metrics": model.step_metrics(),
        "names": sorted(n for n, _ in model.named_parameters()),
    }


def _gather_full_weights(model: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter's full value on every rank (test-only: the layout is tiny)."""
    mine = {n: full_value(p).clone() for n, p in model.named_parameters()}
    pp = model.comms.pp
    if pp.size == 1:
        return mine
    parts: list = [None] * pp.size
    dist.all_gather_object(parts, mine, group=pp.group)
    return {k: v for part in parts for k, v in part.items()}


def follow_curve(rank: int, world: int, cfg: RunConfig, steps: int = 5) -> dict:
    """``steps`` clipped AdamW steps; each compared with one device from identical weights.

    Before every step the single-device model takes the 3D model's current weights, so the
    check never compares two diverging trajectories: one step's loss, gradients and global
    gradient norm must agree to fp32 reduction-order noise, whatever the CPU's kernels.
    """
    from boostlr.train.optim import build_optimizer

    device = torch.device("cpu")
    model = ParallelModel.build(cfg, device)
    opt = build_optimizer(model.parameters(), cfg.train, fused=False)
    ref = build_model(cfg.model, seed=cfg.train.seed)
    ref_params = dict(ref.named_parameters())
    b, dp_rank = cfg.train.batch_size, model.comms.dp.rank
    mine = slice(dp_rank * b, (dp_rank + 1) * b)
    keys = ("losses", "ref_losses", "vs64", "worst_params", "norms", "ref_norms")
    report: dict = {k: [] for k in keys}
    for _ in range(steps):
        weights = _gather_full_weights(model)
        with torch.no_grad():
            for name, p in ref_params.items():
                p.copy_(weights[name])
        inputs, targets = global_batch(cfg)  # one batch: the loss must fall
        ref.zero_grad()
        ref_loss = ref(inputs, targets)
        ref_loss.backward()
        ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref_params.values()))
        exact = float64_grads(ref, inputs, targets)

        opt.zero_grad()
        loss = float(model.global_mean(model.forward_backward(inputs[mine], targets[mine])))
        layout64, single64, worst_name = 0.0, 0.0, ""
        for name, p in model.named_parameters():
            err = relative_error(full_grad(p), exact[name])
            if err > layout64:
                layout64, worst_name = err, name
            single64 = max(single64, relative_error(ref_params[name].grad, exact[name]))
        norm = float(model.clip_gradients(cfg.train.grad_clip))
        opt.step()
        report["losses"].append(loss)
        report["ref_losses"].append(ref_loss.item())
        report["worst_params"].append(worst_name)
        report["vs64"].append((layout64, single64))
        report["norms"].append(norm)
        report["ref_norms"].append(ref_norm.item())
    report["metrics"] = model.step_metrics()
    report["coords"] = (model.comms.pp.rank, model.comms.dp.rank, model.comms.tp.rank)
    report["local_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    report["fsdp_modules"] = fsdp_module_elements(model)
    return report


def run_cases(rank: int, world: int, cases: list[tuple[str, RunConfig, int]]) -> dict:
    """Several layouts in one process group (a fresh mesh each)."""
    return {label: follow_curve(rank, world, cfg, steps) for label, cfg, steps in cases}


def fsdp_module_elements(model: ParallelModel) -> list[int]:
    """Padded local shard elements of each FSDP module (every block, then the root), for
    each stage this rank holds (an untied embedding and head split over dp are no module's)."""
    dp, tp, tp_rank = model.comms.dp.size, model.comms.tp.size, model.comms.tp.rank
    return [n for part in model.stages for n in _stage_modules(part, dp, tp, tp_rank)]


def _stage_modules(part, dp: int, tp: int, tp_rank: int) -> list[int]:
    def padded(name: str, p: torch.Tensor) -> int:
        shape = list(p.shape)  # global
        dim = part.specs[name].dim
        if dim is not None:
            start, end = chunk_range(shape[dim], tp_rank, tp)
            shape[dim] = end - start
        return -(-shape[0] // dp) * math.prod(shape[1:])

    named = dict(part.model.named_parameters())
    vocab = {n: p for n, p in named.items() if n in VOCAB_PARAMS}
    units: list[int] = []
    if part.ctx.vocab_dp is not None and part.ctx.vocab_dp.size > 1:  # split over dp, no FSDP
        named = {n: p for n, p in named.items() if n not in VOCAB_PARAMS}
    elif not part.model.cfg.tie_embeddings:  # parallel.vocab_dp off: units of their own
        units = [padded(n, p) for n, p in vocab.items()]
        named = {n: p for n, p in named.items() if n not in VOCAB_PARAMS}
    blocks = [
        sum(padded(f"layers.{i}.{n}", p) for n, p in block.named_parameters())
        for i, block in part.model.layers.items()
    ]
    root = sum(padded(n, p) for n, p in named.items() if not n.startswith("layers."))
    return [*blocks, *units, root]


def compare_bf16_step(rank: int, world: int, cfg: RunConfig) -> dict:
    """One bf16 step (FSDP mixed precision under autocast) against one device's autocast."""
    device = torch.device("cpu")
    model = ParallelModel.build(cfg, device)
    inputs, targets = global_batch(cfg)
    b, dp_rank = cfg.train.batch_size, model.comms.dp.rank
    mine = slice(dp_rank * b, (dp_rank + 1) * b)
    model.comms.ledger.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = float(model.global_mean(model.forward_backward(inputs[mine], targets[mine])))
    ref = build_model(cfg.model, seed=cfg.train.seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(inputs, targets)
    ref_loss.backward()
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    exact = float64_grads(ref, inputs, targets)
    grad_dtypes = {str(full_grad(p).dtype) for _, p in model.named_parameters()}
    errors = [
        relative_error(full_grad(p).float(), ref_grads[name])
        for name, p in model.named_parameters()
    ]
    return {
        "loss": loss,
        "ref_loss": ref_loss.item(),
        "worst_grad_error": max(errors),
        # Both runs' errors against the float64 gradients: the bound is the one-device
        # bf16 run's own (fp32_noise.bf16_layout_bound), so it holds on every CPU.
        "layout64": max(
            relative_error(full_grad(p), exact[n]) for n, p in model.named_parameters()
        ),
        "single64": max(relative_error(g, exact[n]) for n, g in ref_grads.items()),
        "grad_dtypes": grad_dtypes,
        "param_dtypes": {str(p.dtype) for _, p in model.named_parameters()},
        "metrics": model.step_metrics(),
        "fsdp_modules": fsdp_module_elements(model),
    }


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (its shard when ``t`` is a DTensor)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def step_once(cfg: RunConfig) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """Build ``cfg`` and take its grad_accum micro-batches of this dp rank's slice of the
    global batch (under the run's autocast), with the experts' gradient rule applied; the
    ledger holds only the step. The optimizer has not stepped yet."""
    model = ParallelModel.build(cfg, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    inputs, targets = global_batch(cfg)
    b, dp_rank = cfg.train.batch_size, model.comms.dp.rank
    mine = slice(dp_rank * b, (dp_rank + 1) * b)
    bf16 = cfg.train.dtype == "bfloat16"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    model.comms.ledger.reset()
    for _ in range(cfg.train.grad_accum):
        with autocast:
            model.forward_backward(inputs[mine], targets[mine])
    model.reduce_expert_gradients()
    return model, opt


def resident_bytes(model: ParallelModel, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes."""
    params = model.parameters()
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v)
            for p in params
            for v in opt.state[p].values()
            if torch.is_tensor(v) and v.dim() > 0
        ),
    }
