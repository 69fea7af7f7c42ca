"""An async checkpoint save touches no GPU from its background threads but the rank's own.

CUDA's current device is per host thread: a new thread starts on device 0. If DCP's writer
thread copied ahead (``torch.cuda.current_stream()``, ``synchronize()``) it would create a
context on device 0 from every rank of a node. Here CUDA is faked as available (the calls
are recorded, not made); the save itself runs for real on CPU tensors.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from boostlr.rundir import writer as writer_module
from boostlr.rundir.writer import CheckpointWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RANK_DEVICE = torch.device("cuda", 3)
# Calls that run on a device (create its context there when there is none).
TOUCHING = {"current_stream", "synchronize", "stream", "stream.synchronize", "stream.wait_stream"}


class _Recorder:
    """Every faked CUDA call, with the thread that made it."""

    def __init__(self) -> None:
        self.calls: list[tuple[threading.Thread, str, tuple]] = []
        self._lock = threading.Lock()

    def note(self, name: str, *args: Any) -> None:
        with self._lock:
            self.calls.append((threading.current_thread(), name, args))

    def fake(self, name: str, result: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.note(name, *args)
            return result() if callable(result) else result

        return call

    def by_other_threads(self) -> dict[str, list[tuple[str, tuple]]]:
        main = threading.main_thread()
        out: dict[str, list[tuple[str, tuple]]] = {}
        for thread, name, args in self.calls:
            if thread is not main:
                out.setdefault(thread.name, []).append((name, args))
        return out


class _FakeStream:
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder

    def synchronize(self) -> None:
        self.recorder.note("stream.synchronize")

    def wait_stream(self, other: Any) -> None:
        self.recorder.note("stream.wait_stream")


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    stream = _FakeStream(recorder)
    for name, result in {
        "is_available": True,
        "device_count": 4,
        "current_device": 0,
        "set_device": None,
        "synchronize": None,
        "current_stream": stream,
        "stream": nullcontext,
    }.items():
        monkeypatch.setattr(torch.cuda, name, recorder.fake(name, result))
    # Pinned staging needs a real GPU; the copy it replaces runs on the caller's thread.
    monkeypatch.setattr(writer_module, "pin_staging", lambda device: False)
    return recorder


def test_an_async_save_makes_no_cuda_call_off_the_rank_device(
    tmp_path: Path, cuda_calls: _Recorder
) -> None:
    writer = CheckpointWriter(tmp_path, 0, None, keep=1, async_save=True, device=RANK_DEVICE)
    # Past DCP's default copy-ahead window (10 MB), so copy-ahead would drain and sync too.
    state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(4)}}
    writer.save(1, state, {"step": 1}, {"cpu": torch.get_rng_state()}, {}, {})
    assert writer.wait() == tmp_path / "step_1"
    writer.close()
    threads = cuda_calls.by_other_threads()
    assert threads, "the save's threads were expected to ask whether CUDA is there"
    for name, calls in threads.items():
        assert not [c for c, _ in calls if c in TOUCHING], f"{name} ran on a device: {calls}"
        assert calls[0] == ("set_device", (RANK_DEVICE,)), f"{name} did not set its device first"
