"""Per-rank bodies for the 3D tests: build a layout, run a step, compare with one device."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from boostlr.config import RunConfig, build_config
from boostlr.models.llama import build_model
from boostlr.parallel.engine import ParallelModel

VOCAB = 101
SEQ = 8


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
    loss = model.global_mean(model.forward_backward(inputs[mine], targets[mine]))

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
