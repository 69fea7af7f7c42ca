"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` (and the ``serialize_file`` beneath it, as of safetensors
0.8) needs every tensor in memory at once, so exporting a model that way costs the whole
model. The format is simple enough to stream: an 8-byte little-endian header length, a JSON
header (``dtype``, ``shape``, ``data_offsets`` per tensor, space-padded to a multiple of 8
bytes), then the raw bytes in header order. Only shapes and dtypes are needed to write the
header, so each tensor is read, written and dropped in turn; the result is byte-for-byte what
``save_file`` writes for the same tensors (same order, same header), which the tests check.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from boostlr.errors import CheckpointError

# safetensors' dtype names, in the order its writer lays tensors out (larger first; ties by
# name): the reverse of the Rust ``Dtype`` enum order, which ``save_file`` sorts by.
_DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ORDER = {dtype: index for index, dtype in enumerate(_DTYPES)}
DTYPE_OF_NAME = {name: dtype for dtype, name in _DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """What the header needs to know about a tensor before it is read."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def write_safetensors(
    path: Path,
    infos: Mapping[str, TensorInfo],
    read: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``infos``' tensors to ``path``, calling ``read(name)`` once per tensor.

    At most one tensor returned by ``read`` is referenced from here at a time. The file is
    fsynced; the caller handles atomicity (write into a temp directory, then rename).
    """
    unknown = sorted({str(i.dtype) for i in infos.values() if i.dtype not in _DTYPES})
    if unknown:
        raise CheckpointError(
            f"cannot write dtype(s) {', '.join(unknown)} to safetensors: convert the "
            "checkpoint's tensors to a standard dtype (float32, bfloat16, ...)"
        )
    order = sorted(infos, key=lambda name: (_ORDER[infos[name].dtype], name))
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in order:
        info = infos[name]
        header[name] = {
            "dtype": _DTYPES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for name in order:
            tensor = read(name)
            info = infos[name]
            if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
                raise CheckpointError(
                    f"tensor {name} reads as {tensor.dtype} {tuple(tensor.shape)} but its "
                    f"metadata says {info.dtype} {info.shape}: the checkpoint is inconsistent; "
                    "use another checkpoint"
                )
            # A flat uint8 view of the contiguous CPU tensor: its bytes, with no extra copy.
            raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            fh.write(raw.numpy().data)
            del tensor, raw
        fh.flush()
        os.fsync(fh.fileno())
