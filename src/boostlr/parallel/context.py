"""What every tensor-parallel strategy needs at run time, passed explicitly."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from boostlr.config import ModelConfig, RunConfig
from boostlr.parallel.collectives import GroupComm
from boostlr.parallel.vocab import VocabSplit, vocab_split


def compute_dtype(name: str) -> torch.dtype:
    """``train.dtype`` as a torch dtype."""
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def wire(t: torch.Tensor) -> torch.Tensor:
    """Cast an activation to the autocast dtype before it (or its gradient) is communicated.

    Under bf16 autocast the residual stream and norm outputs stay fp32; without this cast
    their collectives would move twice the bytes of a bf16 run. fp32 runs are unchanged.
    """
    device = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(device):
        return t.to(torch.get_autocast_dtype(device))
    return t


@dataclass(frozen=True)
class TPContext:
    comm: GroupComm
    cfg: ModelConfig
    norm: str = "online"  # btp: "online" (stats ride with A's all-reduce) | "sync"
    grouping: bool = True  # btp: fused down-projections, batched up-projections
    act_ckpt: str = "none"  # "none" | "lowrank" (btp regions) | "block"
    compile: bool = False  # torch.compile each block; collectives are the graph boundaries
    # btp: each B starts its latents' backward all-reduce before its weight-gradient GEMM
    # (eager only: a compiled region holds no collective).
    tp_overlap: bool = True
    # The LM head GEMM and the cross-entropy as one step (:mod:`boostlr.parallel.head_loss`).
    fused_loss: bool = True
    # The data-parallel group the embedding's and the LM head's rows are split over (instead
    # of FSDP gathering them): :mod:`boostlr.parallel.vocab`. ``None``: not split over dp.
    vocab_dp: GroupComm | None = None
    # train.dtype: the dtype of GEMM inputs and activation collectives (docs/precision.md).
    # The residual stream, master weights and statistics are fp32 whatever it is.
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(
        cls, comm: GroupComm, cfg: RunConfig, vocab_dp: GroupComm | None = None
    ) -> TPContext:
        """The context a run's config asks for, on tensor-parallel group ``comm``."""
        p = cfg.parallel
        return cls(
            comm,
            cfg.model,
            vocab_dp=vocab_dp,
            norm=p.norm,
            grouping=p.grouping,
            act_ckpt=p.act_ckpt,
            compile=cfg.train.compile,
            tp_overlap=p.tp_overlap,
            fused_loss=cfg.train.fused_loss,
            dtype=compute_dtype(cfg.train.dtype),
        )

    @property
    def vocab_dp_size(self) -> int:
        """Data-parallel ranks the vocabulary is split over (1: not split over dp)."""
        return 1 if self.vocab_dp is None else self.vocab_dp.size

    def vocab_split(self, rows_over_tp: bool = True) -> VocabSplit:
        """This rank's vocabulary rows: over ``vocab_dp``, then over TP if ``rows_over_tp``."""
        return vocab_split(self.cfg.vocab_size, self.comm if rows_over_tp else None, self.vocab_dp)

    @property
    def overlap(self) -> bool:
        return self.tp_overlap and not self.compile

    def checkpointed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` under activation checkpointing, its re-forward marked ``recompute``.

        Early stop is off so the re-forward always runs to the end: the ledger then shows
        every collective a recompute re-issues, not just those before the last saved tensor.
        """
        with set_checkpoint_early_stop(False):
            return checkpoint(
                fn,
                *args,
                use_reentrant=False,
                context_fn=lambda: (nullcontext(), self.comm.ledger.recompute()),
            )

    def region(self, tag: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A BTP region (no collective inside): checkpointed under ``act_ckpt=lowrank``.

        Labelled ``region.{tag}`` in profiler traces, ``tag`` being the ledger tag of the
        all-reduce the region ends in (compiled, the region shows as its compiled graph:
        torch.compile drops ``record_function`` and warns about it).

        Compiled, the plain non-reentrant checkpoint is what torch.compile traces into one
        recomputed subgraph (the early-stop switch and the ledger's recompute context would
        break the graph); a region issues no collective, so the ledger needs neither.
        """
        label = nullcontext() if self.compile else torch.profiler.record_function(f"region.{tag}")
        with label:
            if self.act_ckpt != "lowrank":
                return fn(*args)
            if self.compile:
                return checkpoint(fn, *args, use_reentrant=False)
            return self.checkpointed(fn, *args)
