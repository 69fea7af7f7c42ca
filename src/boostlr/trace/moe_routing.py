"""The routing ``plan --trace`` assumes for an MoE model: balanced.

Expert parallelism sizes each all-to-all chunk, and the padded experts their buffer, from
counts read back to the host (:func:`boostlr.models.moe_dispatch.host_counts`). The traced
experts run padded (the grouped GEMM's fake-tensor function takes bf16 only). A fake
tensor has no values to read, so while a rank is traced that read is answered here, and
only here: every rank sends each expert
``T·k / E`` of its ``T·k`` routed copies (the remainder to the first experts) and receives
as many as it sends. Only the function the layer calls for its counts, and the experts'
choice of the grouped form, are swapped, for the trace's duration.

Under that assumption the trace's ep traffic is the plan's exactly; a real run's differs per
rank with its routing (the combine's input is what a rank received) but not summed over an
ep group, and its expert activations differ per rank likewise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from boostlr.config import RunConfig
from boostlr.specs.moe import is_moe

#: Where the layer's count read is looked up (the single-device dropless dispatch, and the
#: expert-parallel one, which imports it by name).
HOST_COUNTS = ("boostlr.models.moe_dispatch", "boostlr.parallel.expert_parallel")
#: Where the experts look up whether they run grouped.
GROUPED_CHOICE = "boostlr.models.moe_experts"
ASSUMPTION = (
    "MoE traced under balanced routing: each expert gets T·k/E of every rank's routed "
    "copies (fake tensors have no routing to read); a real run's ep bytes per rank vary "
    "with its routing, their sum over an ep group does not"
)


def balanced_counts(copies: int, experts: int) -> list[int]:
    """``copies`` spread over ``experts`` as evenly as integers allow."""
    q, rem = divmod(copies, experts)
    return [q + (1 if e < rem else 0) for e in range(experts)]


@contextmanager
def balanced_routing(cfg: RunConfig) -> Iterator[None]:
    """While inside, MoE layers read balanced counts instead of their routing's."""
    m = cfg.model
    if not is_moe(m):
        yield
        return
    import importlib

    # One micro-batch (pp 1); under BTP each TP rank dispatches its 1/tp share of it.
    copies = cfg.train.batch_size * cfg.data.seq_len // cfg.parallel.tp * m.moe_top_k
    sent = balanced_counts(copies, m.moe_experts)

    def host_counts(counts: torch.Tensor) -> list[int]:
        n = counts.numel()
        if n == len(sent):  # the padded experts at ep 1: copies per expert
            return list(sent)
        if n == 2 * len(sent):  # dropless_ep: sent per (rank, expert), then received
            return sent + sent
        if len(sent) % n == 0:  # the padded experts at ep > 1: received per local expert
            return balanced_counts(copies, n)
        raise ValueError(f"balanced routing: unexpected count read of {n} entries")

    with ExitStack() as stack:
        for name in HOST_COUNTS:
            module = importlib.import_module(name)
            saved = module.host_counts
            module.host_counts = host_counts
            stack.callback(setattr, module, "host_counts", saved)
        # The grouped GEMM's fake-tensor (meta) function takes bf16 only: the traced experts
        # run padded, over the balanced counts, whose tensors are the grouped form's rows.
        experts = importlib.import_module(GROUPED_CHOICE)
        chosen = experts.grouped_here
        experts.grouped_here = lambda *_: False
        stack.callback(setattr, experts, "grouped_here", chosen)
        yield
