"""How a batch crosses from host to its device: every batch takes :func:`to_device`.

Device-independent: a platform's :class:`~boostlr.platform.base.CopyPlan` says whether to
pin and queue, and its :class:`~boostlr.platform.base.CopyLane` where copies are queued.
"""

from __future__ import annotations

import torch

from boostlr.platform.registry import platform_for


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to fill with data bound for ``device`` (pinned when the plan says)."""
    return torch.empty(shape, dtype=dtype, pin_memory=platform_for(device).copy_plan.pin)


def copy_steps(t: torch.Tensor, device: torch.device) -> tuple[bool, bool] | None:
    """How :func:`to_device` moves ``t`` to ``device``: ``(pin first, non_blocking)``, or
    ``None`` when it is there already. A pure function of the tensor and the target, so a
    CPU-only test can ask what a GPU rank's copy would do."""
    if t.device == device or (t.device.type == device.type and device.index is None):
        return None
    plan = platform_for(device).copy_plan
    pin_first = plan.pin and platform_for(t.device).is_host and not t.is_pinned()
    return pin_first, plan.non_blocking


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` as its plan says: every batch takes this way.

    A pageable source bound for a GPU is first copied into pinned memory on the host (a
    pageable copy would make the host wait for the device); the training loader builds its
    batches in :func:`host_buffer`, so its batches never need that extra copy.
    """
    steps = copy_steps(t, device)
    if steps is None:
        return t
    pin_first, non_blocking = steps
    if pin_first:
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


class HostToDevice:
    """Starts batches' copies to ``device`` and hands them over when they are needed, on
    the device's copy lane (a side stream on a GPU; plain calls on a CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._lane = platform_for(device).copy_lane(device)

    def start(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with self._lane.queued():
            return tuple(to_device(t, self.device) for t in tensors)

    def ready(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self._lane.hand_over(tensors)
