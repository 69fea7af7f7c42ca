"""train.cpu_alloc_cache: freed large blocks stay in the process (no munmap, no page faults)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from boostlr.train import host_alloc

PROBE = """
import sys, torch
from boostlr.train.host_alloc import keep_freed_host_memory
if sys.argv[1] == "on":
    assert keep_freed_host_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
block = torch.ones(64 * 2**20)  # 256 MiB: far above glibc's largest mmap threshold
del block
print((rss() - base) / 2**20)
"""


def _kept_mb(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_block_stays_resident_only_with_the_cache():
    assert _kept_mb("on") > 200  # served from the heap, kept for the next step
    assert _kept_mb("off") < 50  # default glibc: mmap'd and returned on free


@pytest.mark.skipif(
    host_alloc.find_allocator() is None or "jemalloc" not in str(host_alloc.find_allocator()),
    reason="jemalloc is not installed (.ci/run installs libjemalloc2)",
)
def test_ranks_get_jemalloc_keeping_its_pages_unless_the_user_configures_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(host_alloc.NO_PRELOAD_ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    ranks = host_alloc.allocator_env(True, "cpu")
    assert "jemalloc" in ranks["LD_PRELOAD"].split(":")[0]
    assert ranks["MALLOC_CONF"] == host_alloc.JEMALLOC_KEEP
    assert list(host_alloc.allocator_env(True, "cpu", keep_pages=False)) == ["LD_PRELOAD"]
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    assert "MALLOC_CONF" not in host_alloc.allocator_env(True, "cpu", keep_pages=True)
    assert host_alloc.allocator_env(True, "cuda", keep_pages=True) == {}
    assert host_alloc.allocator_env(False, "cpu") == {}


RELEASE_PROBE = """
import torch
from boostlr.train.host_alloc import release_freed_pages
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
block = torch.ones(64 * 2**20)  # 256 MiB
del block
kept = (rss() - base) / 2**20
print(release_freed_pages(), kept, (rss() - base) / 2**20)
"""


@pytest.mark.skipif(
    host_alloc.find_allocator() is None or "jemalloc" not in str(host_alloc.find_allocator()),
    reason="jemalloc is not installed (.ci/run installs libjemalloc2)",
)
def test_release_gives_back_what_jemalloc_kept() -> None:
    """Pages kept (the ranks' setting) hold a freed block; one release returns it."""
    env = host_alloc.with_allocator({}, str(host_alloc.find_allocator()))
    env["MALLOC_CONF"] = host_alloc.JEMALLOC_KEEP
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    how, kept, after = out.stdout.split()
    assert how == "jemalloc"
    assert float(kept) > 200 and float(after) < 50, out.stdout


ALLOCATED_PROBE = """
import torch
from boostlr.train.host_alloc import allocated_bytes_reader
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
name, allocated = allocated_bytes_reader()
base_rss, base = rss(), allocated()
block = torch.ones(64 * 2**20)  # 256 MiB
held = (allocated() - base) / 2**20
del block
print(name, held, (allocated() - base) / 2**20, (rss() - base_rss) / 2**20)
"""


@pytest.mark.skipif(
    host_alloc.find_allocator() is None or "jemalloc" not in str(host_alloc.find_allocator()),
    reason="jemalloc is not installed (.ci/run installs libjemalloc2)",
)
@pytest.mark.parametrize("keep", [True, False])
def test_allocated_bytes_leave_out_what_the_allocator_keeps(keep: bool) -> None:
    """The count the memory phases sample follows tensors, not the pages jemalloc keeps."""
    env = host_alloc.with_allocator({}, str(host_alloc.find_allocator()))
    if keep:
        env["MALLOC_CONF"] = host_alloc.JEMALLOC_KEEP
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATED_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    name, held, after, resident = out.stdout.split()
    assert name == "jemalloc"
    assert 250 < float(held) < 300 and float(after) < 10, out.stdout
    if keep:  # the pages stay resident; the count does not
        assert float(resident) > 200, out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2")
def test_allocated_bytes_with_glibc() -> None:
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATED_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    name, held, after, _ = out.stdout.split()
    assert name == "glibc"
    assert 250 < float(held) < 300 and float(after) < 10, out.stdout
