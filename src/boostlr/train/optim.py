"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from boostlr.config import TrainConfig


def build_optimizer(
    params: Iterable[nn.Parameter], cfg: TrainConfig, fused: bool = True
) -> torch.optim.AdamW:
    """Weight decay on matrices (linears, embeddings); none on norm gains, as in LLaMA."""
    decay, no_decay = [], []
    for param in params:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if not fused:
        return torch.optim.AdamW(groups, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # fused kernels missing for this device/dtype
        return torch.optim.AdamW(groups, **kwargs)


def init_optimizer_state(optimizer: torch.optim.AdamW) -> None:
    """Create AdamW's (zero) state now, as its first step would, so a checkpoint loads into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                on_device = group.get("fused") or group.get("capturable")
                optimizer.state[p] = {
                    "step": torch.tensor(0.0, device=p.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


Anchor = tuple[int, float]


def lr_at(step: int, cfg: TrainConfig, anchor: Anchor | None = None) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio*lr``.

    ``step`` counts optimizer steps from 0; the schedule is a pure function of it and of
    ``anchor``. A run whose ``train.steps`` changed at a resume gets ``anchor = (s, lr_s)``:
    from optimizer step ``s`` on, the cosine restarts from ``lr_s`` (the rate the old schedule
    had reached there) and decays to the floor over the new remaining steps, so the rate is
    continuous at the resume point instead of jumping back up the old curve.
    """
    floor = cfg.min_lr_ratio * cfg.lr
    if anchor is not None and step >= anchor[0]:
        start, start_lr = anchor
        progress = min(1.0, (step - start) / max(1, cfg.steps - start))
        return floor + 0.5 * (start_lr - floor) * (1 + math.cos(math.pi * progress))
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def reanchor(
    saved: TrainConfig, anchor: Anchor | None, current: TrainConfig, step: int
) -> Anchor | None:
    """The anchor that keeps the rate continuous when ``train.steps`` changes at ``step``.

    In warmup no anchor is needed (warmup does not depend on ``steps``); an unchanged
    ``steps`` keeps the saved anchor.
    """
    if saved.steps == current.steps or step < current.warmup:
        return anchor
    return (step, lr_at(step, saved, anchor))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
