"""Vocab-parallel loss and embedding when a rank's vocabulary slice is tiny or empty.

``torch.chunk`` order gives ``ceil(V / tp)`` rows per rank, so at V=5, TP=4 the ranks hold
2, 2, 1 and 0 rows. On four real gloo ranks the loss, the gradient of the logits, the
embedding output and its weight gradient must equal the single-device ``F.cross_entropy`` /
``F.embedding``, and a whole tiny model at V=5 must train at TP 4 with the single-device
loss and gradients. All checks run inside one spawned group (spawning is the slow part).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from tp_reference import CPU, built, full_grads

from boostlr.config import build_config
from boostlr.models.llama import build_model
from boostlr.parallel.collectives import CommLedger, GroupComm
from boostlr.parallel.context import TPContext
from boostlr.parallel.head_loss import head_cross_entropy
from boostlr.parallel.mesh import build_mesh
from boostlr.parallel.tensor_parallel import TensorParallelModel
from boostlr.parallel.vocab import (
    gather_batch,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_range,
    vocab_split,
)

WORLD = 4
N_TOKENS = 12
# (vocab, logit scale): empty slices on the last ranks (V=5: 2,2,1,0; V=2: 1,1,0,0;
# V=1: 1,0,0,0), a one-row slice (V=7: 2,2,2,1), and logits large enough that an unshifted
# exp would overflow.
CASES = [(5, 1.0), (2, 1.0), (1, 1.0), (7, 1.0), (5, 80.0)]
TOL = dict(rtol=1e-5, atol=1e-6)


def _logits_targets(vocab: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(vocab)
    logits = scale * torch.randn(N_TOKENS, vocab, generator=gen)
    targets = torch.arange(N_TOKENS) % vocab  # every class is a target, the last one too
    return logits, targets


def _check_loss(comm: GroupComm, vocab: int, scale: float) -> dict:
    full, targets = _logits_targets(vocab, scale)
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets)
    ref.backward()
    start, end = vocab_range(vocab, comm)
    local = full[:, start:end].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, vocab_split(vocab, comm))
    loss.backward()
    return {
        "rows": end - start,
        "loss": loss.item(),
        "ref_loss": ref.item(),
        "grad_ok": local.grad is not None
        and torch.allclose(local.grad, ref_logits.grad[:, start:end], **TOL),
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor, natural: float) -> float:
    """Worst element error relative to the largest element, or to the gradient's natural
    size when that is larger (at V=1 the exact gradient is 0). 0 for empty slices."""
    if want.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / max(want.abs().max().item(), natural)).item()


def _check_fused_head(comm: GroupComm, vocab: int, scale: float) -> dict:
    """The fused head + loss on this rank's rows of ``W`` against the unfused single device.

    Chunks of 5 rows do not divide the 12 tokens; this rank's input gradient is its partial
    sum (the strategies reduce it), so the ranks' sum must equal the single-device one.
    """
    gen = torch.Generator().manual_seed(200 + vocab)
    h, weight = (
        scale * torch.randn(N_TOKENS, 3, generator=gen),
        torch.randn(vocab, 3, generator=gen),
    )
    targets = torch.arange(N_TOKENS) % vocab
    ref_h, ref_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(ref_h, ref_w), targets)
    (0.5 * ref).backward()
    start, end = vocab_range(vocab, comm)
    local_h, local_w = h.clone().requires_grad_(), weight[start:end].clone().requires_grad_()
    comm.ledger.reset()
    loss = head_cross_entropy(local_h, local_w, targets, vocab_split(vocab, comm), rows=5)
    (0.5 * loss).backward()
    records = [(r.op, r.tag, r.elements, r.phase) for r in comm.ledger.records]
    grad_h = local_h.grad.clone()
    dist.all_reduce(grad_h)
    return {
        "loss": loss.item(),
        "ref_loss": ref.item(),
        # Each gradient is (softmax - onehot)/N times the other operand.
        "grad_h_error": _relative_error(grad_h, ref_h.grad, weight.abs().max().item() / N_TOKENS),
        "grad_w_error": _relative_error(
            local_w.grad, ref_w.grad[start:end], h.abs().max().item() / N_TOKENS
        ),
        "records": records,
    }


def _check_embedding(comm: GroupComm, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(100 + vocab)
    weight = torch.randn(vocab, 3, generator=gen)
    tokens = torch.arange(2 * N_TOKENS).view(2, N_TOKENS) % vocab
    upstream = torch.randn(2, N_TOKENS, 3, generator=gen)
    ref_w = weight.clone().requires_grad_()
    ref = F.embedding(tokens, ref_w)
    (ref * upstream).sum().backward()
    start, end = vocab_range(vocab, comm)
    local_w = weight[start:end].clone().requires_grad_()
    out = vocab_parallel_embedding(tokens, local_w, vocab_split(vocab, comm), tp=comm)
    (out * upstream).sum().backward()
    return {
        "out_ok": torch.allclose(out, ref, **TOL),
        "grad_ok": local_w.grad is not None
        and torch.allclose(local_w.grad, ref_w.grad[start:end], **TOL),
    }


def _check_model(comm: GroupComm) -> dict:
    """A tiny dense model at V=5 under Megatron TP 4, built as the trainer builds it (its
    ranks' vocabulary slices 2, 2, 1, 0), against the single-device model."""
    overrides = [("model.preset", "tiny"), ("model.arch", "full"), ("train.seed", "1")]
    overrides += [("parallel.tp", str(comm.size)), ("parallel.tp_strategy", "megatron")]
    run_cfg = build_config(overrides=overrides)
    cfg = run_cfg.model
    cfg.vocab_size = 5
    tokens = torch.randint(0, 5, (2, 9), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    single = GroupComm(None, "single", CommLedger())
    reference = TensorParallelModel(build_model(cfg, seed=1), None, TPContext(single, cfg))
    ref_loss = reference(inputs, targets)
    ref_loss.backward()
    tp_model = built(run_cfg, build_mesh(run_cfg.parallel, CPU))
    loss = tp_model.forward_backward(inputs, targets)
    grads = full_grads(tp_model)
    worst = max(
        ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
        for n, p in reference.model.named_parameters()
    )
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "worst_grad_error": worst}


def _dp_tp_groups(rank: int) -> tuple[GroupComm, GroupComm]:
    """dp 2 x tp 2 on the four ranks, tp fastest (as the mesh lays them out)."""
    ledger = CommLedger()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return GroupComm(dp_groups[rank % 2], "dp", ledger), GroupComm(
        tp_groups[rank // 2], "tp", ledger
    )


def _check_dp_split(dp: GroupComm, tp: GroupComm, vocab: int, fused: bool) -> dict:
    """The head and loss with the vocabulary split over dp x tp against one device.

    Each dp rank has its own tokens (the same on its tp ranks). One device sees both dp
    ranks' tokens: its loss is the mean over all of them, its weight gradient the dp mean;
    each dp rank's input gradient must be that of its own tokens' mean loss (``dp`` times
    the one-device gradient of those rows).
    """
    gen = torch.Generator().manual_seed(300 + vocab)
    h_all = torch.randn(dp.size * N_TOKENS, 3, generator=gen)
    weight = torch.randn(vocab, 3, generator=gen)
    t_all = torch.arange(dp.size * N_TOKENS) % vocab
    ref_h, ref_w = h_all.clone().requires_grad_(), weight.clone().requires_grad_()
    F.cross_entropy(F.linear(ref_h, ref_w), t_all).backward()
    split = vocab_split(vocab, tp, dp)
    mine = slice(dp.rank * N_TOKENS, (dp.rank + 1) * N_TOKENS)
    h = h_all[mine].clone().requires_grad_()
    local_w = weight[split.start : split.end].clone().requires_grad_()
    gathered = gather_batch(h, dp, "head_in")
    targets = gather_batch(t_all[mine], dp, "targets")
    if fused:
        loss = head_cross_entropy(gathered, local_w, targets, split, rows=5)
    else:
        loss = vocab_parallel_cross_entropy(F.linear(gathered, local_w), targets, split)
    loss.backward()
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h, group=tp.group)  # the tp slices' partial sums (head_input's job)
    natural = h_all.abs().max().item() / N_TOKENS
    return {
        "rows": split.rows,
        "loss_error": abs(loss.item() - F.cross_entropy(F.linear(h_all, weight), t_all).item()),
        "grad_h_error": _relative_error(grad_h, dp.size * ref_h.grad[mine], natural),
        "grad_w_error": _relative_error(local_w.grad, ref_w.grad[split.start : split.end], natural),
    }


def _check_dp_embedding(dp: GroupComm, tp: GroupComm, vocab: int, rows_over_tp: bool) -> dict:
    """The embedding with rows over dp (and over tp, or columns over tp as BTP's)."""
    gen = torch.Generator().manual_seed(400 + vocab)
    weight = torch.randn(vocab, 4, generator=gen)
    tokens = torch.arange(dp.size * N_TOKENS).view(dp.size, N_TOKENS) % vocab
    upstream = torch.randn(dp.size, N_TOKENS, 4, generator=gen)
    ref_w = weight.clone().requires_grad_()
    ref = F.embedding(tokens, ref_w)
    ((ref * upstream).sum() / dp.size).backward()  # the dp mean of each rank's gradient
    split = vocab_split(vocab, tp if rows_over_tp else None, dp)
    cols = slice(None) if rows_over_tp else slice(tp.rank * 2, tp.rank * 2 + 2)
    local_w = weight[split.start : split.end, cols].clone().requires_grad_()
    mine = slice(dp.rank, dp.rank + 1)
    out = vocab_parallel_embedding(tokens[mine], local_w, split, dp, tp if rows_over_tp else None)
    (out * upstream[mine, :, cols]).sum().backward()
    return {
        "out_ok": torch.allclose(out, ref[mine, :, cols], **TOL),
        "grad_ok": torch.allclose(local_w.grad, ref_w.grad[split.start : split.end, cols], **TOL),
    }


DP_VOCABS = (5, 3, 7)  # V=3 over dp 2 x tp 2: rows 1, 0 on the second dp rank's tp ranks


def _run(rank: int, world_size: int) -> dict:
    comm = GroupComm(dist.group.WORLD, "tp", CommLedger())
    dp, tp = _dp_tp_groups(rank)
    return {
        "loss": {case: _check_loss(comm, *case) for case in CASES},
        "fused": {case: _check_fused_head(comm, *case) for case in CASES},
        "embedding": {vocab: _check_embedding(comm, vocab) for vocab, _ in CASES},
        "model": _check_model(comm),
        "dp_head": {
            (vocab, fused): _check_dp_split(dp, tp, vocab, fused)
            for vocab in DP_VOCABS
            for fused in (True, False)
        },
        "dp_embedding": {
            (vocab, over_tp): _check_dp_embedding(dp, tp, vocab, over_tp)
            for vocab in DP_VOCABS
            for over_tp in (True, False)
        },
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout_s=120)


@pytest.mark.parametrize("case", CASES, ids=[f"V{v}-scale{s:g}" for v, s in CASES])
def test_loss_and_logit_grad_match_single_device(results: list[dict], case: tuple) -> None:
    rows = [r["loss"][case]["rows"] for r in results]
    assert sum(rows) == case[0]
    for rank, res in enumerate(results):
        check = res["loss"][case]
        assert math.isfinite(check["loss"]), f"rank {rank} ({check['rows']} rows)"
        assert check["loss"] == pytest.approx(check["ref_loss"], rel=1e-5)
        assert check["grad_ok"], f"rank {rank} ({check['rows']} rows): logit gradient differs"


@pytest.mark.parametrize("case", CASES, ids=[f"V{v}-scale{s:g}" for v, s in CASES])
def test_fused_head_loss_matches_single_device(results: list[dict], case: tuple) -> None:
    """Loss, the ranks' summed input gradient and each weight slice's gradient; the same
    three ``[N]`` all-reduces as the unfused vocab-parallel loss."""
    for rank, res in enumerate(results):
        check = res["fused"][case]
        assert check["loss"] == pytest.approx(check["ref_loss"], rel=1e-5), f"rank {rank}"
        # fp32: exp of logits of magnitude L carries relative error ~L·2^-24 (L ~ 250 at
        # scale 80), in either summation order.
        bound = 2e-5 if case[1] > 1 else 1e-6
        assert check["grad_h_error"] < bound, f"rank {rank}: {check['grad_h_error']}"
        assert check["grad_w_error"] < bound, f"rank {rank}: {check['grad_w_error']}"
        assert check["records"] == [
            ("all_reduce", tag, N_TOKENS, "fwd") for tag in ("ce_max", "ce_sum_exp", "ce_target")
        ]


def test_empty_slices_occur(results: list[dict]) -> None:
    """The cases really exercise empty slices (guards the test against a changed split)."""
    assert [r["loss"][(5, 1.0)]["rows"] for r in results] == [2, 2, 1, 0]


@pytest.mark.parametrize("vocab", sorted({v for v, _ in CASES}))
def test_embedding_matches_single_device(results: list[dict], vocab: int) -> None:
    for rank, res in enumerate(results):
        assert res["embedding"][vocab] == {"out_ok": True, "grad_ok": True}, f"rank {rank}"


def test_tiny_vocab_model_at_tp4(results: list[dict]) -> None:
    for res in results:
        check = res["model"]
        assert math.isfinite(check["loss"])
        assert check["loss"] == pytest.approx(check["ref_loss"], rel=1e-5)
        assert check["worst_grad_error"] < 2e-5


@pytest.mark.parametrize("vocab", DP_VOCABS)
def test_vocabulary_split_over_dp_and_tp_matches_one_device(
    results: list[dict], vocab: int
) -> None:
    """Rows nested dp first, then tp; the loss, the input gradient of each dp rank's own
    mean loss and the weight gradient (the dp mean) as one device, fused and unfused."""
    rows = [r["dp_head"][(vocab, True)]["rows"] for r in results]
    assert sum(rows) == vocab
    if vocab == 3:
        assert rows == [1, 1, 1, 0]  # an empty slice on the last rank
    for rank, res in enumerate(results):
        for fused in (True, False):
            check = res["dp_head"][(vocab, fused)]
            assert check["loss_error"] < 1e-5, (rank, fused, check)
            assert check["grad_h_error"] < 1e-5, (rank, fused, check)
            assert check["grad_w_error"] < 1e-5, (rank, fused, check)
        for over_tp in (True, False):
            assert res["dp_embedding"][(vocab, over_tp)] == {"out_ok": True, "grad_ok": True}, (
                rank,
                over_tp,
            )
