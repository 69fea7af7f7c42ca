"""Checkpoints survive crashes: SIGKILL mid-save, a rank dying mid-run, async saves.

Crashes are real: ``BOOSTLR_CRASH_AT`` makes a rank SIGKILL itself at a named point of the
save (or after a step) in the first attempt, as the OOM killer would. Resumed runs must end
bitwise where an uninterrupted run ends (same layout, CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_cases import group_timeouts, save_memory, slow_rank_save_and_load
from distributed import run_distributed
from test_train import read_rows, tiny_run_config, train_rows
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from boostlr.config import build_config
from boostlr.rundir.checkpoint import list_checkpoints
from boostlr.rundir.verify import newest_verified_checkpoint
from boostlr.train import run as trainer

pytestmark = pytest.mark.slow

MiB = 1 << 20


def two_rank_config(data: Path, **extra: object):
    return tiny_run_config(data, **{"parallel.tp": 2, "train.ckpt_every": 2, **extra})


@pytest.fixture(scope="module")
def uninterrupted(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    trainer.train(two_rank_config(small_dataset), run, console=False)
    return train_rows(run)


# Every crash point leaves the survivor as the newest verified checkpoint; a resume from it
# (a launch more, CI's time) is checked at the two ends of the save.
@pytest.mark.parametrize(
    ("point", "survivor", "resume"),
    [
        ("ckpt_before_shards:4@1", 2, True),  # rank 1 dies before writing its shards
        ("ckpt_after_shards:4@0", 2, False),  # all shards written, no meta.json yet
        ("ckpt_before_rename:4@0", 2, False),  # meta.json written, still in the temp dir
        ("ckpt_before_dir_fsync:4@0", 4, True),  # renamed: the new checkpoint is complete
    ],
)
def test_sigkill_during_a_save_keeps_a_valid_checkpoint(
    small_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    uninterrupted: dict,
    point: str,
    survivor: int,
    resume: bool,
) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("BOOSTLR_CRASH_AT", point)
    with pytest.raises(ChildFailedError):
        trainer.train(two_rank_config(small_dataset), run, console=False)
    monkeypatch.delenv("BOOSTLR_CRASH_AT")
    newest, corrupted = newest_verified_checkpoint(run / "checkpoints")
    assert newest is not None and newest.step == survivor and not corrupted
    if not resume:
        return
    trainer.train(build_config(run / "config.toml"), run, resume=True, console=False)
    assert train_rows(run) == uninterrupted
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [2, 4, 6]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_a_killed_rank_restarts_and_async_saves_end_bitwise_equal(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict
) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("BOOSTLR_CRASH_AT", "step:5@1")  # after step 5; newest save is step 4
    cfg = two_rank_config(small_dataset, **{"parallel.max_restarts": 1, "train.async_ckpt": True})
    result = trainer.train(cfg, run, console=False)
    rows = read_rows(run)
    # Step 4's async save may still have been in flight when rank 1 died: then step 2.
    restarts = [r for r in rows if r.get("event") == "restart"]
    assert restarts in ([{"event": "restart", "step": s, "attempt": 1}] for s in (2, 4))
    assert train_rows(run) == uninterrupted
    assert result.loss == uninterrupted[6]
    # The last save was asynchronous and still in flight at exit: finished, not dropped.
    newest, _ = newest_verified_checkpoint(run / "checkpoints")
    assert newest is not None and newest.step == 6
    blocked = [r for r in rows if "ckpt_block_s" in r]
    assert [r["step"] for r in blocked][-2:] == [4, 6] and all(r["async"] for r in blocked)


def test_save_memory_stays_within_the_shards_plus_one_tensor(tmp_path: Path) -> None:
    """Measured: a sampling thread reads /proc/self/statm every millisecond during the save.

    Sync saves stream each local shard to its file: growth <= the largest tensor plus 16 MiB
    of DCP planning and allocator slack. An async save first copies the shards to host
    memory: growth <= the shards plus that. A gathered save would grow by the full model.
    """
    for async_save in (False, True):
        root = tmp_path / f"async_{async_save}"
        for report in run_distributed(save_memory, 2, str(root), async_save):
            bound = report["largest"] + 16 * MiB
            if async_save:
                bound += report["shard_bytes"]
            assert report["shard_bytes"] > 24 * MiB  # the measurement is meaningful
            assert report["growth"] <= bound, (async_save, report)


def test_every_process_group_gets_the_configured_timeout() -> None:
    for timeouts in run_distributed(group_timeouts, 4):
        assert timeouts == {"tp": 42.0, "dp": 42.0, "pp": 42.0, "ckpt": 42.0}


# Rank 1 moves its 96 MiB just above the slowest rate the timeout rule assumes (20 MiB/s):
# about 4.4 s behind rank 0, past the 2 s floor, within 2 s + 96 MiB at 20 MiB/s (6.8 s).
FLOOR_S, SHARD_MIB, PACE_S_PER_MIB = 2.0, 96, 0.0458


def test_saves_and_loads_wait_as_long_as_the_shards_take_to_move(tmp_path: Path) -> None:
    args = (FLOOR_S, SHARD_MIB, PACE_S_PER_MIB)
    for slow in ("save", "load"):
        reports = run_distributed(
            slow_rank_save_and_load, 2, str(tmp_path / slow), *args, True, slow
        )
        for report in reports:
            assert report == {"timeout_s": FLOOR_S + SHARD_MIB / 20, "save": "ok", "load": "ok"}


@pytest.mark.parametrize("slow", ["save", "load"])
def test_a_checkpoint_group_left_at_the_floor_times_out_in_one_line(
    tmp_path: Path, slow: str
) -> None:
    # 6 s behind, far past the floor whatever the disk adds: rank 0 is the one that times out.
    args = (FLOOR_S, 8, 0.75)
    rank0 = run_distributed(slow_rank_save_and_load, 2, str(tmp_path), *args, False, slow)[0]
    assert rank0["timeout_s"] == FLOOR_S and ("save" in rank0) == (slow == "load")
    assert rank0["error"] == (
        f"CollectiveTimeout: the checkpoint (gloo) group timed out after {FLOOR_S:g} s: another "
        "rank did not reach the same collective in time (it is slower, stuck or gone)"
    )
