"""The real launchers: ``srun`` under a one-node SLURM and two ``torchrun`` agents.

Both must give, bit for bit, the losses of ``boostlr train`` starting its own ranks, and a
``--resume`` under srun must continue them. The SLURM fixture runs ``munged``, ``slurmctld``
and ``slurmd`` from a temporary directory (its own config, key, ports, state and logs), so it
touches nothing of the host's, and stops exactly the processes it started, by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from boostlr.errors import EXIT_STOPPED

pytestmark = pytest.mark.slow

WORLD = 4  # dp 2 x tp 2
TRAIN_ARGS = [
    "--model.preset", "tiny",
    "--data.seq_len", "32",
    "--data.val_batches", "2",
    "--train.batch_size", "4",
    "--train.steps", "4",
    "--train.warmup", "2",
    "--train.log_every", "1",
    "--train.eval_every", "2",
    "--train.ckpt_every", "2",
    "--parallel.dp", "2",
    "--parallel.tp", "2",
    "--parallel.device", "cpu",
    "--quiet",
]  # fmt: skip
SLURM_DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
RUN_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (pytest may itself run
    under srun or torchrun), plus ``extra``; one thread per rank."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (*launcher, "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> None:
    proc = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _train_cmd(run_dir: Path, data: Path | None, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "boostlr.cli", "train", "--run-dir", str(run_dir)]
    if resume:
        return [*cmd, "--resume", "--quiet"]
    return [*cmd, "--data.path", str(data), *TRAIN_ARGS]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def own_launch(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The reference: ``boostlr train`` starting its four ranks itself."""
    run = tmp_path_factory.mktemp("own") / "run"
    _run(_train_cmd(run, small_dataset), _clean_env(), run.parent)
    losses = _losses(run)
    assert list(losses) == [1, 2, 3, 4]
    return losses


def _wait_idle(node: str, env: dict[str, str], logs: Path, procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            break
        out = subprocess.run(
            ["sinfo", "-h", "-n", node, "-o", "%t"], env=env, capture_output=True, text=True
        )
        state = out.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    tails = "\n".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in sorted(logs.iterdir())
    )
    raise AssertionError(f"SLURM node {node} not idle (state {state!r}):\n{tails}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster on this host; yields the environment that reaches it."""
    if os.geteuid() != 0:
        pytest.skip("a one-node SLURM needs root to run slurmd (run the suite as root, as CI does)")
    missing = [name for name in SLURM_DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing): apt-get install "
                    "slurm-wlm munge")  # fmt: skip
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)  # munged wants its socket's directories searchable by all
    logs, state, spool, munge = (root / d for d in ("log", "state", "spool", "munge"))
    for d in (logs, state, spool, munge):
        d.mkdir(mode=0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = munge / "munge.socket"
    node = socket.gethostname().split(".")[0]  # what `hostname -s` prints; slurmd matches it
    with open("/proc/meminfo") as f:
        mem_mb = next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemTotal"))
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=boostlrtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem_mb} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    )
    env = _clean_env(SLURM_CONF=str(conf))
    commands = [
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
         f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed",
         f"--log-file={logs}/munged.log"],
        ["slurmctld", "-D", "-i"],
        ["slurmd", "-D", "-N", node],
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            out = open(logs / f"{cmd[0]}.out", "w")  # noqa: SIM115 (closed with the daemon)
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            out.close()
            if cmd[0] == "munged":
                for _ in range(100):
                    if socket_path.exists():
                        break
                    time.sleep(0.1)
        _wait_idle(node, env, logs, procs, timeout_s=90)
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _srun(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``srun -n 4``, its ranks rendezvousing on an explicitly free local port.

    ``--overcommit`` lets four tasks share fewer CPUs (CI machines may have two).
    """
    return ["srun", "-n", str(WORLD), "--overcommit", "--kill-on-bad-exit=1"], {
        **env,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }


def test_srun_trains_and_resumes_like_own_launch(
    slurm: dict[str, str],
    own_launch: dict[int, float],
    small_dataset: Path,
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    prefix, env = _srun(slurm)
    _run([*prefix, *_train_cmd(run, small_dataset)], env, tmp_path)
    assert _losses(run) == own_launch  # bitwise: same layout, same data order

    # Killed between the step-2 and step-4 checkpoints: resume under srun re-does 3 and 4.
    shutil.rmtree(run / "checkpoints" / "step_4")
    prefix, env = _srun(slurm)
    _run([*prefix, *_train_cmd(run, None, resume=True)], env, tmp_path)
    assert _losses(run) == own_launch
    assert (run / "checkpoints" / "step_4").is_dir()


def test_two_torchrun_agents_train_like_own_launch(
    own_launch: dict[int, float], small_dataset: Path, tmp_path: Path
) -> None:
    """Two agents ("nodes") of two ranks each meet at a c10d rendezvous on localhost."""
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{_free_port()}"
    env = _clean_env()
    agents = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", str(WORLD // 2), "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "boostlr-test",
            "-m", "boostlr.cli", *_train_cmd(run, small_dataset)[3:],
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [a.communicate(timeout=RUN_TIMEOUT_S)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for a, out in zip(agents, outputs, strict=True):
        assert a.returncode == 0, out[-3000:]
    assert _losses(run) == own_launch


def _wait_for_row(run: Path, proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Until the run has logged step 1 (the ranks are training)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and _losses(run):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step logged (exit {proc.poll()})")


def test_usr1_to_srun_saves_exits_75_and_resumes(
    slurm: dict[str, str],
    own_launch: dict[int, float],
    small_dataset: Path,
    tmp_path: Path,
) -> None:
    """srun passes a SIGUSR1 on to its tasks: every rank saves the step it is in, srun exits
    75 (the ranks' code), and the one ``--resume`` continues to the uninterrupted losses.

    (A SIGTERM to srun itself kills the step's tasks at once, SIGKILL, in SLURM 22.05: SLURM's
    own SIGTERM, on preemption, ``scancel`` or the time limit, goes to the tasks directly.)"""
    run = tmp_path / "run"
    prefix, env = _srun(slurm)
    proc = subprocess.Popen(
        [*prefix, *_train_cmd(run, small_dataset)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_row(run, proc)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    stopped = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and "(SIGUSR1)" in stopped[0], err[-3000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert (run / "checkpoints" / f"step_{step}" / "meta.json").is_file()
    prefix, env = _srun(slurm)
    _run([*prefix, *_train_cmd(run, None, resume=True)], env, tmp_path)
    assert _losses(run) == own_launch


def test_slurms_end_time_stops_the_run_before_it(
    slurm: dict[str, str], small_dataset: Path, tmp_path: Path
) -> None:
    """``train.time_limit auto`` under a one-minute srun job: the run reads the job's end
    time (squeue here: this SLURM sets no SLURM_JOB_END_TIME) and saves and exits 75 before
    SLURM would kill it."""
    run = tmp_path / "run"
    one_rank = ["--train.steps", "100000", "--parallel.dp", "1", "--parallel.tp", "1"]
    cmd = [*_train_cmd(run, small_dataset), *one_rank]  # the later overrides win
    proc = subprocess.run(
        ["srun", "-n", "1", "--time=1", *cmd],
        env=slurm,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    assert "(the time limit is near)" in proc.stderr
    assert list((run / "checkpoints").glob("step_*"))
