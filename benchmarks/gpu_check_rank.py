"""What ``benchmarks/gpu_check.py`` runs inside each torchrun rank, around ``boostlr.cli.main``.

* Host syncs per step: under ``torch.cuda.set_sync_debug_mode("warn")`` on CUDA, and the
  ``.item()``-style conversions (the CPU proxy ``tests/test_host_syncs.py`` counts) on both.
* Strict determinism (``strict``): ``torch.use_deterministic_algorithms(True)`` without
  ``warn_only`` before anything runs (the parent sets ``CUBLAS_WORKSPACE_CONFIG`` before CUDA
  starts). torch's SDPA sources (``attention_backward.cu``, ``sdp_utils.cpp``; read, not yet
  seen on a GPU here) say this does not refuse attention: the flash and memory-efficient
  backward switch to their deterministic kernels (only ``warn_only`` keeps the others, with a
  warning), and cuDNN attention is not chosen. The mode in force when the rank ends is
  reported: boostlr's host (CPU) runs set ``warn_only`` themselves.
* CUDA calls by thread (:class:`CudaThreads`): with one rank per GPU, NCCL needs every CUDA
  call of a rank on that rank's GPU. A thread's current device starts at 0, so a thread that
  has not called ``torch.cuda.set_device`` with the rank's device (the main one included)
  would make a CUDA context on GPU 0 of every node. One GPU cannot show that; the
  thread that made each call, and whether it had set the device, can.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

CONVERSIONS = ("item", "__float__", "__bool__", "tolist", "__int__")
# torch.cuda entry points that act on the calling thread's current device (classes such as
# Stream and Event stay unwrapped: isinstance checks on them must keep working).
CUDA_CALLS = (
    "synchronize",
    "current_stream",
    "default_stream",
    "set_stream",
    "stream",
    "current_device",
    "empty_cache",
    "mem_get_info",
    "current_blas_handle",
)


class CudaThreads:
    """Records which thread makes each ``torch.cuda`` call, and whether it set its device."""

    def __init__(self, cuda: ModuleType, rank_device: int, names: tuple[str, ...] = CUDA_CALLS):
        self.cuda, self.rank_device = cuda, rank_device
        self.names = tuple(n for n in names if hasattr(cuda, n))
        self.set_by_thread: dict[int, int] = {}
        self.calls: Counter = Counter()  # (thread name, main?, call, device set?) -> count
        self._saved: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def _note(self, name: str) -> None:
        thread = threading.current_thread()
        ok = self.set_by_thread.get(thread.ident) == self.rank_device
        main = thread is threading.main_thread()
        with self._lock:
            self.calls[(thread.name, main, name, ok)] += 1

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._note(name)
            return original(*args, **kwargs)

        return wrapper

    def install(self) -> CudaThreads:
        set_device = self.cuda.set_device

        def recording_set_device(device: Any) -> None:
            set_device(device)
            index = device if isinstance(device, int) else getattr(device, "index", None)
            if isinstance(device, str):
                index = int(device.split(":")[1]) if ":" in device else 0
            self.set_by_thread[threading.get_ident()] = index

        self._saved["set_device"] = set_device
        self.cuda.set_device = recording_set_device
        for name in self.names:
            self._saved[name] = getattr(self.cuda, name)
            setattr(self.cuda, name, self._wrap(name, self._saved[name]))
        return self

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(self.cuda, name, original)
        self._saved.clear()

    def report(self) -> dict[str, Any]:
        rows = [
            {"thread": t, "main": m, "call": c, "device_set": ok, "count": n}
            for (t, m, c, ok), n in sorted(self.calls.items())
        ]
        return {
            "rank_device": self.rank_device,
            "calls": rows,
            "unset": [r for r in rows if not r["device_set"]],
            "other_threads": sorted({r["thread"] for r in rows if not r["main"]}),
        }


def rank_train(report_path: Path, argv: list[str], strict: bool) -> int:
    """``boostlr.cli.main(argv)`` in this torchrun rank, with the counts above."""
    import torch

    from boostlr.cli import main
    from boostlr.train.profiling import StepProfiler

    if strict:
        torch.use_deterministic_algorithms(True)
    counts: dict[int, Counter] = {}
    current = {"step": 0}
    main_thread = threading.main_thread()

    def count(kind: str) -> None:
        # Another thread (the async checkpoint writer) does not hold up the step's queue.
        where = "" if threading.current_thread() is main_thread else " (background thread)"
        counts.setdefault(current["step"], Counter())[kind + where] += 1

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            count(name)
            return original(self, *args, **kwargs)

        return original, wrapper

    originals = {}
    for name in CONVERSIONS:
        originals[name], wrapper = counting(name)
        setattr(torch.Tensor, name, wrapper)
    before_step = StepProfiler.before_step

    def mark(self, step: int) -> None:
        current["step"] = step
        before_step(self, step)

    StepProfiler.before_step = mark
    cuda = torch.cuda.is_available()
    threads = None
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        threads = CudaThreads(torch.cuda, local).install()
    synchronize = torch.cuda.synchronize

    def counted_sync(*args, **kwargs):
        count("cuda.synchronize")
        return synchronize(*args, **kwargs)

    torch.cuda.synchronize = counted_sync
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            count("sync_debug")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    if cuda:
        warnings.filterwarnings("always", message=".*synchronizing.*")
        torch.cuda.set_sync_debug_mode("warn")
    try:
        return main(argv)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        StepProfiler.before_step = before_step
        torch.cuda.synchronize = synchronize
        if threads is not None:
            threads.uninstall()
        warnings.showwarning = shown
        report = {
            "syncs": {str(step): dict(c) for step, c in sorted(counts.items())},
            "deterministic": {
                "enabled": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            },
            "cuda_threads": threads.report() if threads is not None else None,
        }
        report_path.write_text(json.dumps(report, indent=1))
