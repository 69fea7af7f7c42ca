"""Host memory for CPU ranks: a caching allocator without glibc's ratchet.

A CPU training step allocates the same large tensors every step (logits, their gradients,
FSDP's gathered buffers). glibc serves each one above its mmap threshold with a fresh
``mmap``, so the kernel zero-fills it page by page again every step. Keeping them in glibc's
heap (``mallopt``: no mmap, no trim) avoids that, but glibc then fails to reuse freed
64-byte-aligned chunks (torch's CPU alignment) once small allocations sit in their slack,
and the heap only grows. jemalloc and tcmalloc keep freed memory for reuse without that
ratchet, so the launcher preloads one of them into CPU ranks when the library is on
the machine (Debian: ``libjemalloc2``); the ``mallopt`` cache remains the fallback without
one. On CUDA none of this matters: the caching allocator holds device memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from boostlr.platform import platform_for

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP_ALL = 2**31 - 1

# Set (to anything) to keep glibc with the mallopt cache even where jemalloc is installed.
NO_PRELOAD_ENV = "BOOSTLR_NO_ALLOCATOR_PRELOAD"

# jemalloc with its freed pages kept for reuse, never purged on a timer: a step reallocates
# the same large buffers, and purging them made the kernel fault them in again. What the
# build freed (one full parameter at a time, FSDP's setup) would stay resident too, so a
# rank gives that back once, after building (:func:`release_freed_pages`).
JEMALLOC_KEEP = "dirty_decay_ms:-1,muzzy_decay_ms:-1"

# mallctl's "every arena" index (jemalloc's MALLCTL_ARENAS_ALL).
_JEMALLOC_ALL_ARENAS = 4096

# Preferred first; the sonames Debian/Ubuntu and RHEL ship.
ALLOCATOR_SONAMES = ("libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def find_allocator() -> str | None:
    """The path of an installed jemalloc/tcmalloc to preload, or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    for soname in ALLOCATOR_SONAMES:
        for directory in _LIB_DIRS:
            path = Path(directory) / soname
            if path.is_file():
                return str(path)
    return None


def preloaded_allocator() -> str | None:
    """The jemalloc/tcmalloc this process runs with (it was preloaded), or ``None``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "jemalloc" in path or "tcmalloc" in path:
            return path
    return None


def with_allocator(env: dict[str, str], library: str) -> dict[str, str]:
    """``env`` with ``library`` first in ``LD_PRELOAD`` (once)."""
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if library in current:
        return env
    return {**env, "LD_PRELOAD": ":".join([library, *current])}


def allocator_env(enabled: bool, device_type: str, keep_pages: bool = True) -> dict[str, str]:
    """Environment for CPU ranks to start with a caching allocator preloaded.

    Empty when not on CPU, when ``train.cpu_alloc_cache`` is off, or when no jemalloc or
    tcmalloc is installed (the ranks then fall back to the ``mallopt`` cache). ``keep_pages``
    (the default, one process or several) also tells jemalloc to keep its freed pages
    (:data:`JEMALLOC_KEEP`), unless the user set ``MALLOC_CONF``.
    """
    if not enabled or not platform_for(device_type).is_host or os.environ.get(NO_PRELOAD_ENV):
        return {}
    library = preloaded_allocator() or find_allocator()
    if library is None:
        return {}
    env = {"LD_PRELOAD": with_allocator(dict(os.environ), library)["LD_PRELOAD"]}
    if keep_pages and "jemalloc" in Path(library).name and "MALLOC_CONF" not in os.environ:
        env["MALLOC_CONF"] = JEMALLOC_KEEP
    return env


def release_freed_pages() -> str:
    """Give the pages the allocator holds free back to the system, once; what did it.

    For a rank that has just built its model: with jemalloc keeping freed pages, the build's
    transients (each full parameter drawn on CPU, FSDP's setup) would stay resident for the
    whole run. jemalloc: flush this thread's cache and purge every arena (``mallctl``);
    tcmalloc: ``MallocExtension_ReleaseFreeMemory``; glibc: ``malloc_trim(0)``. ``"none"``
    where no allocator offers it. Run once at start-up, never in the step.
    """
    process = ctypes.CDLL(None)
    mallctl = _mallctl(process)
    if mallctl is not None:
        mallctl(b"thread.tcache.flush", None, None, None, 0)
        purge = f"arena.{_JEMALLOC_ALL_ARENAS}.purge".encode()
        return "jemalloc" if mallctl(purge, None, None, None, 0) == 0 else "none"
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return "tcmalloc"
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim(0)
        return "glibc"
    return "none"


def keep_freed_host_memory() -> bool:
    """Serve large allocations from glibc's heap and never trim it; ``False`` if not glibc.

    The fallback cache when no jemalloc/tcmalloc is preloaded. Safe to call more than once
    and at any time: it only changes how later allocations are served.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_ALL))


def cache_host_memory() -> str:
    """What ``train.cpu_alloc_cache`` does in this rank: ``"jemalloc"``-like, or ``"mallopt"``.

    With a preloaded caching allocator nothing is needed; otherwise glibc's heap is told to
    keep what it frees (``"none"`` where even that is unavailable).
    """
    library = preloaded_allocator()
    if library is not None:
        return Path(library).name
    return "mallopt" if keep_freed_host_memory() else "none"


def _mallctl(process: ctypes.CDLL):
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        mallctl.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p)
        mallctl.argtypes += (ctypes.c_void_p, ctypes.c_size_t)
    return mallctl


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
        + ("uordblks", "fordblks", "keepcost")
    ]


def allocated_bytes_reader() -> tuple[str, Callable[[], int]] | None:
    """``(allocator, read)``: ``read()`` is the bytes the process has allocated and not freed.

    Unlike the resident set, this leaves out what the allocator keeps free for reuse (jemalloc
    with its pages kept, glibc's untrimmed heap): it is the CPU's counterpart of CUDA's
    ``memory_allocated``, the tensors plus the interpreter's own objects. jemalloc:
    ``stats.allocated`` (after an ``epoch`` refresh); tcmalloc:
    ``generic.current_allocated_bytes``; glibc: ``mallinfo2`` (heap in use plus mmapped
    blocks). ``None`` where the allocator offers none of these.
    """
    process = ctypes.CDLL(None)
    mallctl = _mallctl(process)
    if mallctl is not None:
        epoch, value, size = ctypes.c_uint64(1), ctypes.c_size_t(0), ctypes.c_size_t(8)

        def jemalloc() -> int:
            mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
            size.value = ctypes.sizeof(value)
            mallctl(b"stats.allocated", ctypes.byref(value), ctypes.byref(size), None, 0)
            return value.value

        return ("jemalloc", jemalloc) if jemalloc() > 0 else None
    numeric = getattr(process, "MallocExtension_GetNumericProperty", None)
    if numeric is not None:
        numeric.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t))
        held = ctypes.c_size_t(0)

        def tcmalloc() -> int:
            numeric(b"generic.current_allocated_bytes", ctypes.byref(held))
            return held.value

        return "tcmalloc", tcmalloc
    mallinfo2 = getattr(process, "mallinfo2", None)  # glibc >= 2.33
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2

        def glibc() -> int:
            info = mallinfo2()
            return info.uordblks + info.hblkhd

        return "glibc", glibc
    return None
