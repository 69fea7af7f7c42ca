"""The fused LM head + cross-entropy on one device (the vocab-parallel case: test_vocab.py).

Against the unfused ``F.cross_entropy(F.linear(h, W))``: loss and both gradients in fp32
(chunks that do and do not divide the tokens, a loss scaled before backward, weight rows past
the vocabulary), in bf16 autocast, and through the model with ``fused_loss`` on and off. What
the backward keeps is counted through autograd's saved-tensor hooks: one ``[N, V]`` buffer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boostlr.config import build_config
from boostlr.models.llama import build_model
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.head_loss import head_cross_entropy
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.parallel.vocab import vocab_split

N, D, V = 24, 16, 50
SINGLE = GroupComm(None, "single", CommLedger())


def _inputs(seed: int = 0, extra_rows: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(V + extra_rows, D, generator=gen) / D**0.5
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[0] = V - 1  # the last class is a target too
    return h, w, targets


def _grads(fused: bool, h, w, targets, chunk_rows=8, scale=1.0, dtype=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        if fused:
            loss = head_cross_entropy(h, w, targets, vocab_split(V, SINGLE), chunk_rows)
        else:
            loss = F.cross_entropy(F.linear(h, w[:V]).float(), targets)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool((got - want).abs().max() <= rel * want.abs().max())


@pytest.mark.parametrize("chunk_rows", [1, 5, 8, 24, 100])
def test_fp32_matches_unfused(chunk_rows: int) -> None:
    h, w, t = _inputs()
    loss, gh, gw = _grads(True, h, w, t, chunk_rows)
    ref_loss, ref_gh, ref_gw = _grads(False, h, w, t)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert _close(gh, ref_gh, 1e-6) and _close(gw, ref_gw, 1e-6)


def test_evaluation_loss_without_gradients() -> None:
    """Under no_grad (evaluation) the buffer is never turned into a gradient: same loss."""
    h, w, t = _inputs(2)
    with torch.no_grad():
        loss = head_cross_entropy(h, w, t, vocab_split(V, SINGLE), 7)
    assert loss.item() == pytest.approx(F.cross_entropy(h @ w.t(), t).item(), rel=1e-6)


def test_scaled_loss_and_rows_past_the_vocabulary() -> None:
    """A loss scaled before backward (accumulation, pipelines) scales both gradients; weight
    rows past ``vocab_size`` take no part and get a zero gradient."""
    h, w, t = _inputs(extra_rows=3)
    loss, gh, gw = _grads(True, h, w, t, scale=0.25)
    ref_loss, ref_gh, ref_gw = _grads(False, h, w, t, scale=0.25)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert gw.shape == w.shape and not gw[V:].any()
    assert _close(gh, ref_gh, 1e-6) and _close(gw[:V], ref_gw[:V], 1e-6)


def test_bf16_autocast_matches_unfused() -> None:
    """GEMMs in bf16, the softmax in fp32, gradients back in the inputs' dtype."""
    h, w, t = _inputs(1)
    loss, gh, gw = _grads(True, h, w, t, dtype=torch.bfloat16)
    ref_loss, ref_gh, ref_gw = _grads(False, h, w, t, dtype=torch.bfloat16)
    assert gh.dtype == gw.dtype == torch.float32
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    assert _close(gh, ref_gh, 2e-2) and _close(gw, ref_gw, 2e-2)


def _saved_bytes(fused: bool) -> int:
    h, w, t = _inputs()
    h.requires_grad_()
    w.requires_grad_()
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        if fused:
            head_cross_entropy(h, w, t, vocab_split(V, SINGLE), 8)
        else:
            F.cross_entropy(F.linear(h, w).float(), t)
    return sum(saved)


def test_backward_keeps_one_logits_sized_buffer() -> None:
    logits = N * V * 4
    inputs = (N * D + V * D) * 4
    assert _saved_bytes(True) <= logits + inputs + N * 8
    assert _saved_bytes(False) >= 2 * logits  # logits and log-softmax at least


@pytest.mark.parametrize("arch", ["cola", "full"])
def test_model_fused_loss_on_and_off(arch: str) -> None:
    cfg = build_config(overrides=[("model.preset", "tiny"), ("model.arch", arch)]).model
    cfg.vocab_size = 97
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    results = []
    for fused in (True, False):
        ctx = TPContext(GroupComm(None, "single", CommLedger()), cfg, fused_loss=fused)
        model = TensorParallelModel(build_model(cfg, seed=2), None, ctx)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.model.named_parameters()}))
    (loss_f, grads_f), (loss_u, grads_u) = results
    assert loss_f == pytest.approx(loss_u, rel=1e-6)
    for name, g in grads_u.items():
        assert _close(grads_f[name], g, 1e-5), name


def test_benchmark_runs_and_reports_both_variants() -> None:
    """benchmarks/head_loss.py on a tiny shape: one row per dtype and variant."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "head_loss.py"
    args = ["--tokens", "32", "--dim", "16", "--vocab", "64", "--rounds", "1", "--reps", "1"]
    out = subprocess.run(
        [sys.executable, str(script), *args, "--threads", "1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("float32 ", "bfloat16 "))]
    assert [(r[0], r[1]) for r in rows] == [
        (d, v) for d in ("float32", "bfloat16") for v in ("unfused", "fused")
    ]
    assert all(float(r[2]) > 0 and r[4].endswith("x") for r in rows)
