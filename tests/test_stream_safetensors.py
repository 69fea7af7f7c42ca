"""The streaming safetensors writer: same bytes as ``save_file``, one tensor held at a time."""

from __future__ import annotations

import gc
import json
import struct
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from boostlr.errors import CheckpointError
from boostlr.stream_safetensors import TensorInfo, write_safetensors

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Every supported dtype, odd shapes (scalar, empty, 3-d), names out of order."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(3, 5), (), (0, 4), (2, 3, 7), (1,)][i % 5]
        out[f"t{(7 * i) % len(DTYPES):02d}.{dtype}".replace("torch.", "")] = (
            100 * torch.randn(shape, generator=gen)
        ).to(dtype)
    out["z.transposed"] = torch.arange(12.0).view(3, 4).t()  # non-contiguous
    return out


def stream(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> list[str]:
    """Write ``tensors`` with the streaming writer; return the order they were read in."""
    order: list[str] = []

    def read(name: str) -> torch.Tensor:
        order.append(name)
        return tensors[name]

    infos = {k: TensorInfo(v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    write_safetensors(path, infos, read, metadata=metadata)
    return order


# One metadata key at most: safetensors does not fix the order of several (a hash map).
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_bytes_equal_save_file(tmp_path: Path, metadata: dict | None) -> None:
    tensors = mixed_tensors()
    order = stream(tmp_path / "ours.safetensors", tensors, metadata)
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, tmp_path / "ref.safetensors", metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    assert sorted(order) == sorted(tensors) and len(order) == len(set(order))


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"b": "2", "a": "x y"}])
def test_reads_back_with_safetensors(tmp_path: Path, metadata: dict | None) -> None:
    tensors = mixed_tensors()
    path = tmp_path / "ours.safetensors"
    stream(path, tensors, metadata)
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        raw = loaded[name].reshape(-1).view(torch.uint8)
        assert torch.equal(raw, tensor.contiguous().reshape(-1).view(torch.uint8)), name
    with safe_open(path, framework="pt") as fh:
        assert fh.metadata() == metadata


def test_header_is_space_padded_to_8_bytes(tmp_path: Path) -> None:
    for n in range(1, 9):  # header lengths over every residue mod 8
        path = tmp_path / f"{n}.safetensors"
        stream(path, {"x" * n: torch.zeros(n)})
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = raw[8 : 8 + length]
        json_part = header.rstrip(b" ")
        assert length % 8 == 0 and len(header) - len(json_part) < 8
        assert json.loads(json_part)["x" * n]["data_offsets"] == [0, 4 * n]
        assert len(raw) == 8 + length + 4 * n


def test_only_one_tensor_is_alive_at_a_time(tmp_path: Path) -> None:
    """Each tensor is dropped before the next one is read: the point of streaming."""
    alive: list[weakref.ref] = []
    infos = {f"w{i}": TensorInfo(torch.float32, (64, 64)) for i in range(6)}

    def read(name: str) -> torch.Tensor:
        gc.collect()
        assert all(ref() is None for ref in alive), "an earlier tensor is still referenced"
        tensor = torch.full((64, 64), float(name[1:]))
        alive.append(weakref.ref(tensor))
        return tensor

    write_safetensors(tmp_path / "w.safetensors", infos, read)
    loaded = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[f"w{i}"], torch.full((64, 64), float(i))) for i in range(6))


@pytest.mark.parametrize(
    "wrong", [torch.zeros(3, dtype=torch.float64), torch.zeros(4), torch.zeros(1, 3)]
)
def test_a_tensor_not_matching_its_info_is_an_error(tmp_path: Path, wrong: torch.Tensor) -> None:
    with pytest.raises(CheckpointError, match=r"tensor a reads as .* metadata says"):
        write_safetensors(tmp_path / "x", {"a": TensorInfo(torch.float32, (3,))}, lambda n: wrong)


def test_unsupported_dtype_is_an_error(tmp_path: Path) -> None:
    infos = {"c": TensorInfo(torch.complex128, (2,))}
    with pytest.raises(CheckpointError, match="complex128"):
        write_safetensors(tmp_path / "x", infos, lambda n: torch.zeros(2, dtype=torch.complex128))
