"""The memory model's activations per block against what autograd really keeps.

``boostlr plan`` predicts a rank's activation memory as bytes per block times the blocks and
micro-batches it holds. Here that per-block estimate is held against the tensors autograd
saves for the backward (every distinct storage a ``saved_tensors_hooks`` pack sees, the
parameters left out), on real tensor-parallel ranks: the difference between a two-block and
a one-block model is one block's activations, whatever the embedding and head keep.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from parallel_cases import layout_config

from boostlr.analysis.memory import activation_bytes_per_block
from boostlr.config import RunConfig
from boostlr.parallel.engine import ParallelModel

BATCH, SEQ, VOCAB = 2, 32, 256

# (arch, tp strategy, act_ckpt) at tp 2; the one-device cases use the strategy only to build.
TP2_CASES = [
    ("cola", "btp", "none"),
    ("cola", "btp", "lowrank"),
    ("cola", "btp", "block"),
    ("full", "megatron", "none"),
]
TP1_CASES = [("cola", "btp", "none"), ("full", "megatron", "none")]


def _config(arch: str, strategy: str, act_ckpt: str, tp: int, layers: int) -> RunConfig:
    extra = {
        "model.preset": "small",
        "model.n_layers": layers,
        "data.seq_len": SEQ,
        "train.batch_size": BATCH,
        "parallel.act_ckpt": act_ckpt,
    }
    cfg = layout_config(arch, strategy, 1, 1, tp, **extra)
    cfg.model.vocab_size = VOCAB
    return cfg


def _saved_bytes(cfg: RunConfig) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward/backward."""
    model = ParallelModel.build(cfg, torch.device("cpu"))

    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()

    params = {storage(p).data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage(t)
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    return sum(saved.values())


def _per_block(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[int]:
    return [
        _saved_bytes(_config(*case, world, 2)) - _saved_bytes(_config(*case, world, 1))
        for case in cases
    ]


@pytest.mark.parametrize("world, cases", [(2, TP2_CASES), (1, TP1_CASES)])
def test_activations_per_block_match_what_autograd_saves(world: int, cases: list) -> None:
    measured = run_distributed(_per_block, world, cases)[0]
    for case, saved in zip(cases, measured, strict=True):
        arch, strategy, act_ckpt = case
        model = _config(arch, strategy, act_ckpt, world, 1).model
        planned = activation_bytes_per_block(
            model, strategy if world > 1 else None, world, BATCH * SEQ, 4, act_ckpt
        )
        assert saved > 0, case
        # The plan counts tensors by shape, not what one CPU's kernels happen to keep:
        # within the 15% the issue asks of the whole memory model.
        assert planned == pytest.approx(saved, rel=0.15), (case, planned, saved)
