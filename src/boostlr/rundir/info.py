"""``boostlr ckpt info``: what a checkpoint holds, and whether its files are intact.

Reads only ``meta.json``, the files it lists (each hashed once) and the model entries'
shapes (``.metadata`` of a sharded checkpoint, the header of ``model.safetensors``), never
the trainer state, so it works for every checkpoint kind and does not depend on the format
number. A problem is reported as a :class:`~boostlr.errors.CheckpointError` naming the first
bad file, which the CLI turns into one line and exit code 2.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from boostlr.config import ModelConfig
from boostlr.errors import CheckpointError
from boostlr.rundir.checkpoint import sha256_of
from boostlr.rundir.layout import META_FILE, STEP_DIR, checkpoints_dir
from boostlr.rundir.tensors import ModelTensors
from boostlr.specs.arch import is_lowrank
from boostlr.specs.moe import is_saved_buffer

_EARLIER = "use an earlier checkpoint"


def find_checkpoint_dir(path: Path) -> Path:
    """``path`` itself, or the newest ``step_N`` (with a ``meta.json``) of a run directory.

    The newest is taken even when it is damaged, so that ``info`` reports the damage rather
    than silently describing an older checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: pass a checkpoint or run directory")
    if (path / META_FILE).is_file():
        return path
    root = checkpoints_dir(path) if checkpoints_dir(path).is_dir() else path
    steps = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / META_FILE).is_file():
                steps.append((int(match.group(1)), child))
    if not steps:
        raise CheckpointError(
            f"{path} is not a checkpoint (no {META_FILE}): pass runs/<run>/checkpoints/step_N "
            "or a run directory"
        )
    return max(steps)[1]


def inspect_checkpoint(path: Path, progress: bool = False) -> dict[str, Any]:
    """Verify every file listed in ``meta.json`` and describe the checkpoint.

    Sizes are checked for all files before any is hashed, so a truncated or missing file is
    found at once; then each file is hashed once (a progress bar on stderr if ``progress``).
    """
    ckpt = find_checkpoint_dir(path)
    meta = _read_meta(ckpt)
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, entry in sorted(files.items()):
        file = ckpt / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: {name} is missing: {_EARLIER}")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint {ckpt}: {name} has {size:,} bytes but meta.json lists "
                f"{entry['size']:,} (truncated or overwritten): {_EARLIER}"
            )
    total = sum(entry["size"] for entry in files.values())
    with _hash_progress(progress, total) as advance:
        for name, entry in sorted(files.items()):
            try:
                digest = sha256_of(ckpt / name, advance)
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint {ckpt}: cannot read {name} ({exc.strerror}): check its "
                    "permissions and the disk"
                ) from None
            if digest != entry["sha256"]:
                raise CheckpointError(
                    f"checkpoint {ckpt}: {name} fails its sha256 check (corrupt): {_EARLIER}"
                )
    tensors = ModelTensors(ckpt, meta)
    # The parameters alone: an MoE checkpoint also holds its routers' balance biases.
    params = [i for n, i in tensors.infos.items() if not is_saved_buffer(n)]
    return {
        "path": str(ckpt),
        "step": meta["step"],
        "format": meta.get("format"),
        "sharded": bool(meta.get("sharded")),
        "layout": meta.get("layout"),
        "model": (meta.get("config") or {}).get("model"),
        "parameters": sum(i.nbytes // i.dtype.itemsize for i in params),
        "tensors": len(params),
        "parameter_bytes": sum(i.nbytes for i in params),
        "files": [{"name": n, **files[n]} for n in sorted(files)],
        "total_size": total,
        "verified": True,
    }


def format_info(info: dict[str, Any]) -> str:
    """The human-readable report (``info`` as returned by :func:`inspect_checkpoint`)."""
    kind = "sharded (torch.distributed.checkpoint)" if info["sharded"] else "one file"
    lines = [
        f"checkpoint  {info['path']}",
        f"step        {info['step']}",
        f"format      {info['format']}, {kind}",
        f"layout      {_layout(info['layout'])}",
        f"model       {_model(info['model'])}",
        f"parameters  {info['parameters']:,} in {info['tensors']} tensors "
        f"({_human(info['parameter_bytes'])})",
        "files",
    ]
    width = max(len(f["name"]) for f in info["files"])
    for f in info["files"]:
        lines.append(f"  {f['name']:<{width}}  {f['size']:>15,} B  {_human(f['size']):>9}")
    total = info["total_size"]
    lines.append(f"  {'total':<{width}}  {total:>15,} B  {_human(total):>9}")
    lines.append(f"verified: sha256 of all {len(info['files'])} files match meta.json")
    return "\n".join(lines)


def _read_meta(ckpt: Path) -> dict[str, Any]:
    foreign = f"{ckpt / META_FILE} is not a boostlr checkpoint manifest"
    fix = "pass a checkpoint written by boostlr train, or an earlier one"
    try:
        meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{foreign} ({exc}): {fix}") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    valid = (
        isinstance(files, dict)
        and isinstance(meta.get("step"), int)
        and all(_is_file_entry(e) for e in files.values())
        # names are relative file names inside the checkpoint, never paths out of it
        and all(Path(n).name == n and n not in ("", ".", "..") for n in files)
    )
    if not valid:
        raise CheckpointError(f"{foreign} (no step or file list): {fix}")
    return meta


def _is_file_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
    )


@contextlib.contextmanager
def _hash_progress(enabled: bool, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n_bytes)``; a transient bar on stderr when it is a terminal."""
    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield lambda n: None
        return
    columns = (TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("verify", total=total)
        yield lambda n: bar.advance(task, n)


def _layout(layout: Any) -> str:
    if not isinstance(layout, dict):
        return "not recorded"
    parts = [" x ".join(f"{k} {layout[k]}" for k in ("pp", "dp", "tp") if k in layout)]
    if layout.get("ep"):  # experts over ep ranks carved out of dp (recorded only at ep > 1)
        parts.append(f"ep {layout['ep']}")
    if layout.get("strategy"):
        parts.append(f"strategy {layout['strategy']}")
    return ", ".join(parts)


def _model(model: Any) -> str:
    if not isinstance(model, dict):
        return "not recorded"
    arch = str(model.get("arch", "?"))
    parts = [f"{arch} (preset {model['preset']})" if model.get("preset") else arch]
    keys = (
        ("dim", "dim"),
        ("n_layers", "layers"),
        ("n_heads", "heads"),
        ("n_kv_heads", "kv heads"),
        ("ffn_dim", "ffn"),
        ("vocab_size", "vocab"),
    )
    parts += [f"{label} {model[key]}" for key, label in keys if key in model]
    if is_lowrank(model.get("arch")) and "rank" in model:
        parts.append(f"rank {model['rank']}")
    if model.get("tie_embeddings"):
        parts.append("tied embeddings")
    if model.get("moe_experts"):  # MoE keys are written only where not at their default
        top_k = model.get("moe_top_k", ModelConfig.moe_top_k)
        parts.append(
            f"MoE {model['moe_experts']} experts (top {top_k}, ffn {model['moe_ffn_dim']})"
        )
    return ", ".join(parts)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
