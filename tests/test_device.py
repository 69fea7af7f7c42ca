"""The platform: rank -> GPU mapping, backend choice, the copy plan, the event pool, the
choice of a platform per device kind, and the one-line error of a rank asked for a GPU it
cannot see (through the real CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from boostlr import platform as dev
from boostlr.data import BatchLoader, TokenDataset
from boostlr.errors import ConfigError
from boostlr.parallel.ledger import CommLedger
from boostlr.platform import platform_for

SRC = Path(__file__).parents[1] / "src"


# ----------------------------------------------------------------------------- device mapping


@pytest.mark.parametrize(
    ("local_rank", "count", "local_world", "index"),
    [
        (0, 8, 8, 0),
        (5, 8, 8, 5),  # every GPU of the node visible: the local rank
        (3, 1, None, 0),  # srun --gpus-per-task=1 / a CUDA_VISIBLE_DEVICES per task: cuda:0
        (0, 1, 1, 0),
        (9, 8, None, 1),  # a launcher's local ranks beyond the GPUs wrap around
        (3, 4, 4, 3),
    ],
)
def test_a_rank_drives_local_rank_modulo_its_visible_gpus(
    local_rank: int, count: int, local_world: int | None, index: int
) -> None:
    assert dev.local_device_index(local_rank, count, {}, local_world) == index


def test_a_rank_without_a_gpu_names_its_visible_devices() -> None:
    env = {"RANK": "3", "CUDA_VISIBLE_DEVICES": "GPU-1a2b"}
    with pytest.raises(ConfigError) as err:
        dev.local_device_index(3, 0, env, 4)
    line = str(err.value)
    assert "rank 3" in line and "CUDA_VISIBLE_DEVICES=GPU-1a2b" in line and "\n" not in line
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=<unset>"):
        dev.local_device_index(0, 0, {})


def test_two_ranks_on_one_gpu_are_refused() -> None:
    """Under torchrun (LOCAL_WORLD_SIZE) every local rank sees the same GPUs."""
    with pytest.raises(ConfigError, match=r"4 ranks on this node .* 2 GPU\(s\)"):
        dev.local_device_index(3, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, 4)
    with pytest.raises(ConfigError, match=r"2 ranks on this node .* 1 GPU\(s\)"):
        dev.local_device_index(0, 1, {"CUDA_VISIBLE_DEVICES": "0"}, 2)
    platform_for(torch.device("cpu")).check_local_ranks(8)  # CPU ranks need none


def test_binding_on_this_machine() -> None:
    """The real binding: a CPU rank keeps its device; a CUDA rank on a machine without a GPU
    gets the one-line error naming its CUDA_VISIBLE_DEVICES (here, where none is)."""
    cpu = torch.device("cpu")
    assert platform_for(cpu).bind_rank(cpu, {"LOCAL_RANK": "1"}) is cpu
    if torch.cuda.is_available():
        bound = platform_for("cuda").bind_rank(torch.device("cuda"), {"LOCAL_RANK": "0"})
        assert bound == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        return
    env = {"RANK": "2", "CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ConfigError, match=r"rank 2 sees no CUDA GPU \(CUDA_VISIBLE_DEVICES=5\)"):
        platform_for("cuda").bind_rank(torch.device("cuda"), env)


def test_backend_and_process_group_arguments() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert platform_for(cpu).backend == "gloo"
    assert platform_for(gpu).backend == "nccl"
    assert platform_for(cpu).process_group_kwargs(cpu) == {"backend": "gloo"}
    assert platform_for(gpu).process_group_kwargs(gpu) == {
        "backend": "nccl",
        "device_id": torch.device("cuda", 1),
    }
    assert dev.fsdp_in_place_collectives("gloo") and not dev.fsdp_in_place_collectives("nccl")
    options = dev.platform_of_backend("gloo").group_options(timedelta(seconds=7))
    assert options._timeout == timedelta(seconds=7)


def test_a_device_chooses_its_platform_by_kind_and_backend() -> None:
    """One platform per kind and per backend, each a complete ``Platform``; a kind or a
    backend of none is refused by name, except where FSDP asks about a traced run's."""
    kinds = [p.kind for p in dev.PLATFORMS]
    assert len(set(kinds)) == len(kinds) == len({p.backend for p in dev.PLATFORMS})
    assert all(isinstance(p, dev.Platform) for p in dev.PLATFORMS)
    assert isinstance(platform_for(torch.device("cpu")), dev.HostPlatform)
    assert isinstance(platform_for("cuda:3"), dev.CudaPlatform)
    assert dev.platform_of_backend("nccl") is platform_for("cuda")
    assert dev.host_platform() is platform_for("cpu") and dev.HOST_BACKEND == "gloo"
    with pytest.raises(ValueError, match=r"'meta'.*cpu \(gloo\), cuda \(nccl\)"):
        platform_for(torch.device("meta"))
    with pytest.raises(ValueError, match="'fake'"):
        dev.platform_of_backend("fake")
    assert not dev.fsdp_in_place_collectives("fake")
    auto = dev.resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_new_kind_must_state_every_fact_and_method() -> None:
    """A kind is one class: leaving out a fact fails at its definition, a method when it is
    made (so before :data:`PLATFORMS` could hold it)."""
    with pytest.raises(TypeError, match="leaves copy_plan, draw_chunk_counters"):

        class Partial(dev.Platform):
            kind, backend, is_host, fsdp_in_place_collectives = "xpu", "xccl", False, False

    class Facts(dev.Platform):
        kind, backend, is_host, fsdp_in_place_collectives = "xpu", "xccl", False, False
        copy_plan, draw_chunk_counters = dev.CopyPlan(True, True, True), 1

    with pytest.raises(TypeError, match="abstract"):
        Facts()  # type: ignore[abstract]


def test_the_generators_a_checkpoint_keeps_come_back() -> None:
    """Every platform's generators under their keys (the CPU's first), and put back."""
    states = dev.rng_states()
    assert next(iter(states)) == "cpu"
    assert len(states) == 1 + (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    drawn = torch.rand(4)
    torch.rand(8)
    dev.set_rng_states(states)
    assert torch.equal(torch.rand(4), drawn)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without GPU")
def test_cli_with_cuda_and_no_gpu_exits_2_with_one_line(small_dataset: Path, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "CUDA_VISIBLE_DEVICES": "", "RANK": "0"}
    env.update(WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    args = ["--model.preset", "tiny", "--data.path", str(small_dataset), "--quiet"]
    for launcher in (False, True):  # boostlr's own launch, and a rank torchrun started
        run_env = env if launcher else {k: v for k, v in env.items() if k != "RANK"}
        run = tmp_path / f"run{launcher}"
        proc = subprocess.run(
            [sys.executable, "-m", "boostlr.cli", "train", "--run-dir", str(run), *args]
            + ["--parallel.device", "cuda"],
            capture_output=True,
            text=True,
            timeout=300,
            env=run_env,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and "CUDA_VISIBLE_DEVICES=" in lines[0], lines
        assert ("rank 0" in lines[0]) == launcher and not run.exists()


# ----------------------------------------------------------------------------- copies


def test_the_copy_plan_pins_and_queues_for_a_gpu_and_does_nothing_on_a_cpu() -> None:
    gpu_plan = dev.CopyPlan(pin=True, non_blocking=True, side_stream=True)
    assert platform_for("cuda").copy_plan == gpu_plan
    assert platform_for("cpu").copy_plan == dev.CopyPlan(False, False, False)
    t = torch.arange(6)
    assert dev.to_device(t, torch.device("cpu")) is t
    buffer = dev.host_buffer((2, 3), torch.int64, torch.device("cpu"))
    assert buffer.shape == (2, 3) and not buffer.is_pinned()


def test_a_loader_on_a_device_hands_out_the_same_batches_and_state(small_dataset: Path) -> None:
    """Prefetching one batch ahead changes neither the batches nor the saved position, over
    an epoch boundary and after a state is loaded mid-epoch."""
    train = TokenDataset(small_dataset, "train")
    plain = BatchLoader(train, 4, 32, seed=3, dp_rank=1, dp_size=2, grad_accum=2)
    ahead = BatchLoader(train, 4, 32, 3, 1, 2, 2, device=torch.device("cpu"))
    for _ in range(plain.batches_per_epoch + 3):
        assert plain.state_dict() == ahead.state_dict()
        a, b = next(plain), next(ahead)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    state = plain.state_dict()
    for _ in range(2):
        next(ahead)
    ahead.load_state_dict(state)  # the batch fetched ahead is for another position now
    for _ in range(3):
        a, b = next(plain), next(ahead)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- timing


class _StreamEvent:
    """An event on a simulated stream: complete once the simulated clock passes it."""

    clock = {"now": 0.0, "done_until": 0.0}

    def record(self) -> None:
        self.at = self.clock["now"]

    def query(self) -> bool:
        return self.at <= self.clock["done_until"]

    def synchronize(self) -> None:
        self.clock["done_until"] = max(self.clock["done_until"], self.at)

    def elapsed_time(self, end: _StreamEvent) -> float:
        assert self.query() and end.query()
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_the_event_pool_stays_the_size_of_the_work_in_flight() -> None:
    """Two events per collective are no longer kept until the log step: the events of work
    the device has finished are read without waiting and reused."""
    clock = _StreamEvent.clock
    clock.update(now=0.0, done_until=0.0)
    timer = dev.EventTimer(_StreamEvent, harvest_at=8)
    for i in range(1000):
        with timer.timed("tp" if i % 2 else "dp"):
            clock["now"] += 0.5
        clock["now"] += 0.25
        clock["done_until"] = clock["now"] - 2.0  # the device runs a few regions behind
    assert timer.created <= 2 * 8 + 2 * 4  # not 2000
    seconds = timer.take()  # waits for the rest
    assert seconds == pytest.approx({"tp": 250.0, "dp": 250.0})
    assert timer.take() == {}


def test_the_ledger_times_host_blocking_regions_by_wall_time_on_cpu() -> None:
    ledger = CommLedger()
    assert ledger.take_seconds() == {}
    with ledger.timed("tp", torch.device("cpu")):
        torch.ones(1000).sum()
    first = ledger.take_seconds()
    assert set(first) == {"tp"} and first["tp"] > 0
    assert ledger.take_seconds() == {}
