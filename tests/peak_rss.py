"""Peak memory that one export adds, measured in a fresh process (run by test_export.py).

usage: ``python peak_rss.py {streamed|gathered} WARMUP_CHECKPOINT CHECKPOINT OUT``; prints
one JSON object whose ``growth`` is the measure, in bytes.

torch allocates tensor memory through its own CPU allocator, which ``tracemalloc`` does not
see, so this measures what the kernel sees instead: ``growth`` is the process's resident set
high-water mark after the export (``VmHWM``) minus its resident size just before it
(``VmRSS``), both from ``/proc/self/status``. The high-water mark is reset right before the
export (writing 5 to ``/proc/self/clear_refs``), so an earlier peak is not counted; where
the reset is not allowed it keeps this process's own earlier peak and ``growth`` is then an
upper bound. (``ru_maxrss`` would not do: Linux carries it across ``fork`` and ``exec``, so
it reports the parent pytest's size.) A warm-up run of the same code on a tiny checkpoint
first imports every module and touches every code path, so none of that is counted. Linux
only.

``streamed`` is :func:`boostlr.export.export_checkpoint`; ``gathered`` is the export as it
was before it streamed (the whole model in memory, then ``save_file``), kept here to show
that the measurement does see torch's allocations.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from boostlr.export import export_checkpoint, hf_state_dict
from boostlr.rundir.checkpoint import load_model_state, open_checkpoint


def gathered_export(checkpoint: Path, out: Path) -> None:
    state = hf_state_dict(load_model_state(open_checkpoint(checkpoint)))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")


def status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def main(mode: str, warmup: Path, checkpoint: Path, out: Path) -> None:
    export = {"streamed": export_checkpoint, "gathered": gathered_export}[mode]
    export(warmup, out / "warmup")
    gc.collect()
    reset = reset_peak()
    before = status_bytes("VmRSS")
    export(checkpoint, out / "export")
    peak = status_bytes("VmHWM")
    print(json.dumps({"growth": peak - before, "rss_before": before, "peak": peak, "reset": reset}))


if __name__ == "__main__":
    main(sys.argv[1], *(Path(a) for a in sys.argv[2:5]))
