"""Rendezvous under srun without torchrun: the first host of SLURM's node list (expanded
here, no ``scontrol``) and a port from the job id, both overridable by the environment."""

from __future__ import annotations

import os

import pytest

from boostlr.errors import BoostlrError
from boostlr.parallel import launch
from boostlr.parallel.launch import adopt_slurm_env, expand_nodelist, slurm_port

SLURM_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_NODELIST",
    "SLURM_LAUNCH_NODE_IPADDR",
)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("nid[001234-001237,001240]", [f"nid00123{i}" for i in (4, 5, 6, 7)] + ["nid001240"]),
        ("a[1-3],b5", ["a1", "a2", "a3", "b5"]),
        ("gpu-[01-04]-ib", ["gpu-01-ib", "gpu-02-ib", "gpu-03-ib", "gpu-04-ib"]),
        ("n[1,3-5]x[2-3]", ["n1x2", "n1x3", "n3x2", "n3x3", "n4x2", "n4x3", "n5x2", "n5x3"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),  # no padding: width of "8"
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("c[099-101]", ["c099", "c100", "c101"]),
        ("x[7],y[9-9]", ["x7", "y9"]),
        ("l1.org,gpu[2-3].org", ["l1.org", "gpu2.org", "gpu3.org"]),
        ("[1-2]rack", ["1rack", "2rack"]),
        (" h1 , h2 ", ["h1", "h2"]),
    ],
)  # fmt: skip
def test_nodelist_forms_expand_in_order(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "a[1-3", "a]1[", "a[[1]]", "a[3-1]", "a[x]", "a[1-]", ","])
def test_malformed_nodelists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_the_port_is_stable_per_job_and_unprivileged() -> None:
    assert slurm_port("123456") == slurm_port("123456")
    assert slurm_port("123456") != slurm_port("123457")  # two jobs on one node do not collide
    ports = {slurm_port(str(job)) for job in range(0, 200_000, 7)}
    assert min(ports) >= 1024 and max(ports) < 32768  # below Linux's ephemeral range
    assert slurm_port("123456_7") == slurm_port("1234567")  # array jobs: digits of the id
    assert slurm_port(None) == 29500 and slurm_port("") == 29500


@pytest.fixture(autouse=True)
def _restore_environment():
    """``adopt_slurm_env`` writes RANK, WORLD_SIZE, MASTER_* into ``os.environ`` itself, and
    ``monkeypatch.delenv`` of an absent variable records nothing to undo: without this, a later
    test in the session would think it runs under a launcher of 8 ranks."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _slurm_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    base = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", **values}
    for var, value in base.items():
        monkeypatch.setenv(var, value)


def test_srun_tasks_rendezvous_at_the_first_node_on_the_jobs_port(monkeypatch) -> None:
    _slurm_env(
        monkeypatch,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-[07-08]-ib",
        SLURM_LAUNCH_NODE_IPADDR="10.0.0.1",  # the login node an salloc shell ran srun from
    )
    adopt_slurm_env()
    env = launch.os.environ
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "8", "1")
    assert env["MASTER_ADDR"] == "gpu-07-ib"
    assert env["MASTER_PORT"] == str(launch.SLURM_PORT_BASE + 4242)


def test_the_steps_node_list_wins_and_the_environment_overrides(monkeypatch) -> None:
    _slurm_env(
        monkeypatch,
        SLURM_JOB_ID="9",
        SLURM_JOB_NODELIST="n[1-4]",
        SLURM_STEP_NODELIST="n[3-4]",  # srun -N 2 inside a 4-node allocation
    )
    adopt_slurm_env()
    assert launch.os.environ["MASTER_ADDR"] == "n3"
    _slurm_env(monkeypatch, SLURM_JOB_NODELIST="n[1-4]", MASTER_ADDR="head", MASTER_PORT="1234")
    adopt_slurm_env()
    assert (launch.os.environ["MASTER_ADDR"], launch.os.environ["MASTER_PORT"]) == ("head", "1234")


def test_no_node_list_falls_back_to_localhost_and_a_bad_one_says_what_to_set(
    monkeypatch,
) -> None:
    _slurm_env(monkeypatch)
    adopt_slurm_env()
    assert launch.os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert launch.os.environ["MASTER_PORT"] == "29500"
    _slurm_env(monkeypatch, SLURM_JOB_NODELIST="n[1-")
    with pytest.raises(BoostlrError, match="SLURM_JOB_NODELIST.*set MASTER_ADDR"):
        adopt_slurm_env()


def test_under_torchrun_the_slurm_variables_are_left_alone(monkeypatch) -> None:
    _slurm_env(monkeypatch, SLURM_JOB_NODELIST="n[1-4]", RANK="0", WORLD_SIZE="2")
    adopt_slurm_env()
    assert launch.os.environ["RANK"] == "0" and "MASTER_ADDR" not in launch.os.environ


def test_a_world_mismatch_under_slurm_names_srun_and_the_tasks() -> None:
    """``--parallel.nproc 8`` typed into a batch script of one task: the error says that
    under SLURM the ranks are srun's tasks, not "the launcher started 1 ranks"."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}
    text = launch.world_mismatch(1, 8, slurm)
    assert "SLURM started 1 task (SLURM_NTASKS=1)" in text and "needs 8 ranks" in text
    assert "srun --ntasks 8" in text and "--parallel.nproc starts none" in text
    for env in ({}, {**slurm, "TORCHELASTIC_RUN_ID": "x"}):  # no SLURM; torchrun inside it
        text = launch.world_mismatch(2, 4, env)
        assert text.startswith("the launcher started 2 ranks") and "srun" not in text


def test_train_with_nproc_in_a_one_task_allocation_stops_naming_srun(
    small_dataset, tmp_path
) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    env |= {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "boostlr.cli", "train", "--run-dir", str(tmp_path / "run"),
        "--data.path", str(small_dataset), "--model.preset", "tiny", "--data.seq_len", "32",
        "--parallel.nproc", "2", "--parallel.dp", "2", "--parallel.device", "cpu", "--quiet",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("boostlr: error: SLURM started 1 task")
    assert "srun --ntasks 2" in lines[0]


def test_max_restarts_under_srun_is_named_as_unused(small_dataset, tmp_path) -> None:
    """srun started the (one) rank: ``--parallel.max_restarts`` cannot restart it, and the
    run says so on stderr instead of ignoring it without a word; it trains all the same."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    env |= {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMP_NUM_THREADS": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [
        sys.executable, "-m", "boostlr.cli", "train", "--run-dir", str(tmp_path / "run"),
        "--data.path", str(small_dataset), "--model.preset", "tiny", "--data.seq_len", "32",
        "--train.steps", "1", "--parallel.device", "cpu", "--parallel.max_restarts", "2",
        "--quiet",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # --quiet
    notes = [x for x in out.stderr.splitlines() if "max_restarts" in x]
    assert len(notes) == 1 and "parallel.max_restarts 2 is not used" in notes[0], out.stderr
