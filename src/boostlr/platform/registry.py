"""The device kinds boostlr runs on, and the one place a device picks its :class:`Platform`.

A new kind is one :class:`~boostlr.platform.base.Platform` subclass added to
:data:`PLATFORMS`; everything here asks the classes and names no kind itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from boostlr.platform.base import Platform
from boostlr.platform.cuda import CudaPlatform
from boostlr.platform.host import HostPlatform

# In checkpoint order (the host's generator first); ``auto`` takes the first accelerator
# that is available, else the host.
PLATFORMS: tuple[Platform, ...] = (HostPlatform(), CudaPlatform())
_BY_KIND = {p.kind: p for p in PLATFORMS}
_BY_BACKEND = {p.backend: p for p in PLATFORMS}


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a device, or its type as a string)."""
    kind = torch.device(device).type
    if kind not in _BY_KIND:
        raise ValueError(f"no boostlr platform for device kind {kind!r}: one of {_known()}")
    return _BY_KIND[kind]


def platform_of_backend(backend: str) -> Platform:
    """The platform whose tensors collective backend ``backend`` carries."""
    if backend not in _BY_BACKEND:
        raise ValueError(f"no boostlr platform for backend {backend!r}: one of {_known()}")
    return _BY_BACKEND[backend]


def _known() -> str:
    return ", ".join(f"{p.kind} ({p.backend})" for p in PLATFORMS)


def host_platform() -> Platform:
    """The platform of the host itself (gloo groups beside any accelerator's)."""
    return next(p for p in PLATFORMS if p.is_host)


def resolve_device(name: str, env: Mapping[str, str] | None = None) -> torch.device:
    """``parallel.device`` (``auto`` or a kind) as a torch device; checked before any rank
    starts, so a missing GPU is one line, not a traceback from the first kernel."""
    if name == "auto":
        accelerators = (p for p in PLATFORMS if not p.is_host and p.available())
        return torch.device(next(accelerators, host_platform()).kind)
    platform_for(name).check_available(os.environ if env is None else env)
    return torch.device(name)


def fsdp_in_place_collectives(backend: str) -> bool:
    """Whether FSDP's gathers and reductions on a ``backend`` group run through boostlr's
    in-place calls; a backend of no platform (a traced run's fake one) keeps FSDP's own."""
    platform = _BY_BACKEND.get(backend)
    return platform is not None and platform.fsdp_in_place_collectives


def bind_thread_device(device: torch.device | None) -> None:
    """Make this rank's ``device`` current in the calling thread (a thread pool's
    initializer; ``None``: no device to bind)."""
    if device is not None:
        platform_for(device).bind_thread(device)


def pin_staging(device: torch.device | None) -> bool:
    """Whether a checkpoint save of a rank on ``device`` stages into pinned host memory."""
    return device is not None and platform_for(device).pin_staging()


def rng_states() -> dict[str, torch.Tensor]:
    """The generators a checkpoint keeps: every platform's this process sees (the CPU's as
    ``cpu``, each visible GPU's as ``cuda{i}``)."""
    states: dict[str, torch.Tensor] = {}
    for platform in PLATFORMS:
        states.update(platform.rng_states())
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Puts back what :func:`rng_states` kept, each platform its own generators."""
    for platform in PLATFORMS:
        platform.set_rng_states(states)
