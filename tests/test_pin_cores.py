"""parallel.pin_cores: each local rank gets its own slice of the cores, gloo threads included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, threading
from boostlr.parallel.launch import pin_cpu_cores
mine = pin_cpu_cores()
seen = []
t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print(mine, sorted(os.sched_getaffinity(0)), seen[0])
"""


def _probe(**env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_local_ranks_get_disjoint_cores_and_threads_inherit_them():
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // 2
    for rank in (0, 1):
        mine = cores[rank * per : (rank + 1) * per]
        assert _probe(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank)) == f"{mine} {mine} {mine}"


def test_left_alone_when_alone_oversubscribed_or_bound_by_srun():
    cores = sorted(os.sched_getaffinity(0))
    assert _probe(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0") == f"None {cores} {cores}"
    many = str(len(cores) + 1)
    assert _probe(LOCAL_WORLD_SIZE=many, LOCAL_RANK="0") == f"None {cores} {cores}"
    bound = _probe(LOCAL_WORLD_SIZE="2", LOCAL_RANK="1", SLURM_CPU_BIND_TYPE="mask_cpu:")
    assert bound == f"None {cores} {cores}"
