"""Hardware profiles for the cost model: compute, memory, and the links between GPUs.

A profile is a small TOML file (units a person can check against a data sheet: TFLOP/s,
GB/s, GB, µs). A card's memory is given as ``memory_mib``, the MiB ``nvidia-smi`` reports
as its total: data sheets say "40 GB" for 40 GiB (40960 MiB), so ``memory_gb`` (1e9 bytes,
still read when ``memory_mib`` is absent) would understate it by 7%.

Shipped profiles live in ``boostlr/hardware/``; users add their own to ``$BOOSTLR_HARDWARE``
(a directory) or ``<cache>/hardware`` (``$BOOSTLR_CACHE``, default ``~/.cache/boostlr``),
where ``boostlr calibrate`` writes ``local.toml``. A user file of the same name wins over a
shipped one; ``--hardware path/to/file.toml`` reads one file directly.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from boostlr._toml_write import dumps
from boostlr.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

GB = 1e9
MIB = 1 << 20


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one link class: ``time = alpha + bytes / bandwidth`` per hop."""

    bandwidth: float  # bytes/s per GPU per direction
    latency: float  # seconds per message step
    # Seconds per collective call whatever its size or group (NCCL's own cost model:
    # ``baseLat`` beside the per-step ``hwLat``; 0 for a calibrated link, whose fitted
    # ``latency`` holds it).
    base_latency: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    """What a step time depends on, per GPU (or per CPU process for ``local``)."""

    name: str
    description: str
    memory: float  # bytes usable per device
    gpus_per_node: int
    peak_flops: dict[str, float]  # dtype name -> FLOP/s of a dense matmul at peak
    hbm_bandwidth: float  # bytes/s
    # Achieved fraction of peak for a large GEMM, and the size at which a dimension halves it:
    # efficiency(M, K, N) = gemm_efficiency * prod(x / (x + gemm_half_dim) for x in M, K, N).
    gemm_efficiency: float
    gemm_half_dim: float
    memory_efficiency: float  # achieved fraction of hbm_bandwidth for element-wise kernels
    launch: float  # seconds of fixed cost per kernel (launch + framework/autograd dispatch)
    intra: Link
    inter: Link
    reserved: float = 0.0  # bytes per device not available to tensors (context, workspace)
    # Intra-node links all-to-all (each GPU's bandwidth split over its peers, as NVLink
    # without a switch: a group of g uses (g-1)/(gpus_per_node-1) of it) or switched.
    intra_mesh: bool = False
    # Fraction of the GEMM roofline the attention kernels reach (flash attention on a GPU is
    # close to GEMM speed; a CPU's is not).
    attention_efficiency: float = 1.0
    # Achieved fraction of ``hbm_bandwidth`` of a long streaming pass (the optimizer, the
    # weight casts, gradient accumulation): a STREAM-type figure, not the element-wise fit.
    stream_efficiency: float = 1.0
    # Streaming multiprocessors and the GEMM output tile: the last wave of tiles runs on
    # part of the chip (wave quantization). 0 SMs: not modelled (a CPU).
    sm_count: int = 0
    gemm_tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 128), (128, 64))
    # Host seconds per dispatched aten op (views and no-op casts included: each pays Python,
    # the dispatcher and autograd whether or not it launches a kernel). 0: ``launch``.
    host_op: float = 0.0
    device: str = "gpu"  # what was measured: "gpu" (shipped, or calibrated on CUDA) or "cpu"
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"hardware profile {self.name} has no peak for {dtype}: add "
                f"[compute] {dtype}_tflops to it"
            )
        return self.peak_flops[dtype]

    def gemm_eff(self, m: float, k: float, n: float, count: int = 1, waves: bool = True) -> float:
        """Fraction of peak of ``count`` GEMMs ``[m, k] @ [k, n]`` (one batched kernel): the
        large-GEMM fraction, falling for small dims, times the wave quantization of their
        output tiles (``waves``: a cuBLAS-style tiled kernel)."""
        h = self.gemm_half_dim
        eff = self.gemm_efficiency * (m / (m + h)) * (k / (k + h)) * (n / (n + h))
        return eff * self.wave_efficiency(m, k, n, count) if waves else eff

    def wave_efficiency(self, m: float, k: float, n: float, count: int = 1) -> float:
        """Useful tiles over the tile slots of the waves a GEMM's output occupies: a
        ``[m, n]`` output is ``ceil(m/tm)·ceil(n/tn)`` tiles, run ``sm_count`` at a time
        (NVIDIA's matrix-multiplication performance guide: tile and wave quantization), with
        the library's best tile of ``gemm_tiles``. A grid smaller than the chip is split
        along ``k`` (split-K, as cuBLAS does for such shapes) into as many parts as fill it,
        each at least a tile deep."""
        if self.sm_count < 1:
            return 1.0
        best = 0.0
        for tm, tn in self.gemm_tiles:
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * count
            split = max(1, min(self.sm_count // tiles, int(k // tm)))
            waves = math.ceil(tiles * split / self.sm_count)
            best = max(best, m * n * count * split / (waves * self.sm_count * tm * tn))
        return best

    @property
    def host_op_cost(self) -> float:
        """Seconds of host time per dispatched op (``host_op``, else ``launch``)."""
        return self.host_op or self.launch

    def link(self, group_span: int) -> Link:
        """The slowest link a group spanning ``group_span`` consecutive ranks uses."""
        return self.intra if group_span <= self.gpus_per_node else self.inter

    def to_toml(self) -> str:
        data = {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "device": self.device,
            "memory_gb": self.memory / GB,
            "reserved_gb": self.reserved / GB,
            "gpus_per_node": self.gpus_per_node,
            "compute": {
                **{f"{k}_tflops": v / 1e12 for k, v in self.peak_flops.items()},
                "hbm_gbps": self.hbm_bandwidth / GB,
                "gemm_efficiency": self.gemm_efficiency,
                "gemm_half_dim": self.gemm_half_dim,
                "memory_efficiency": self.memory_efficiency,
                "attention_efficiency": self.attention_efficiency,
                "launch_us": self.launch * 1e6,
                **({"host_op_us": self.host_op * 1e6} if self.host_op else {}),
                "stream_efficiency": self.stream_efficiency,
                "sm_count": self.sm_count,
                "gemm_tiles": [list(t) for t in self.gemm_tiles],
            },
            "intra_node": {
                "bandwidth_gbps": self.intra.bandwidth / GB,
                "topology": "mesh" if self.intra_mesh else "switch",
            },
            "inter_node": {"bandwidth_gbps": self.inter.bandwidth / GB},
        }
        for key, link in (("intra_node", self.intra), ("inter_node", self.inter)):
            data[key]["latency_us"] = link.latency * 1e6
            data[key]["base_latency_us"] = link.base_latency * 1e6
        if self.extra:
            data["measurements"] = self.extra
        return dumps(data)


def _req(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise ConfigError(f"hardware profile {where}: missing key '{key}'")
    return data[key]


def profile_from_dict(data: dict[str, Any], where: str) -> HardwareProfile:
    """Build a profile from parsed TOML; every missing key is named in the error (keys this
    version does not read, such as an older calibration's ``[host]``, are ignored)."""
    compute = _req(data, "compute", where)
    intra, inter = _req(data, "intra_node", where), _req(data, "inter_node", where)
    suffix = "_tflops"
    peaks = {k[: -len(suffix)]: float(v) * 1e12 for k, v in compute.items() if k.endswith(suffix)}
    if not peaks:
        raise ConfigError(f"hardware profile {where}: [compute] needs e.g. bfloat16_tflops")
    try:
        return HardwareProfile(
            name=str(_req(data, "name", where)),
            description=str(data.get("description", "")),
            source=str(data.get("source", "")),
            memory=_memory(data, where),
            reserved=float(data.get("reserved_gb", 0.0)) * GB,
            gpus_per_node=int(_req(data, "gpus_per_node", where)),
            peak_flops=peaks,
            hbm_bandwidth=float(_req(compute, "hbm_gbps", where)) * GB,
            gemm_efficiency=float(_req(compute, "gemm_efficiency", where)),
            gemm_half_dim=float(_req(compute, "gemm_half_dim", where)),
            memory_efficiency=float(_req(compute, "memory_efficiency", where)),
            launch=float(compute.get("launch_us", 0.0)) * 1e-6,
            host_op=float(compute.get("host_op_us", 0.0)) * 1e-6,
            intra=_link(intra, where),
            inter=_link(inter, where),
            stream_efficiency=float(compute.get("stream_efficiency", 1.0)),
            sm_count=int(compute.get("sm_count", 0)),
            gemm_tiles=_tiles(compute.get("gemm_tiles", [[256, 128], [128, 128], [128, 64]])),
            intra_mesh=_topology(intra.get("topology", "switch"), where),
            attention_efficiency=float(compute.get("attention_efficiency", 1.0)),
            device=_device(data.get("device", "gpu"), where),
            extra=dict(data.get("measurements", {})),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hardware profile {where}: bad value ({exc})") from None


def _tiles(value: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(m), int(n)) for m, n in value)


def _link(data: dict[str, Any], where: str) -> Link:
    return Link(
        float(_req(data, "bandwidth_gbps", where)) * GB,
        float(_req(data, "latency_us", where)) * 1e-6,
        float(data.get("base_latency_us", 0.0)) * 1e-6,
    )


def _memory(data: dict[str, Any], where: str) -> float:
    """Bytes per device: ``memory_mib`` (nvidia-smi's total) or else ``memory_gb``."""
    if "memory_mib" in data:
        return float(data["memory_mib"]) * MIB
    if "memory_gb" in data:
        return float(data["memory_gb"]) * GB
    raise ConfigError(f"hardware profile {where}: missing key 'memory_mib' (or 'memory_gb')")


def _device(value: str, where: str) -> str:
    if value not in ("gpu", "cpu"):
        raise ConfigError(f"hardware profile {where}: device must be gpu or cpu")
    return value


def _topology(value: str, where: str) -> bool:
    if value not in ("mesh", "switch"):
        raise ConfigError(f"hardware profile {where}: intra_node.topology must be mesh or switch")
    return value == "mesh"


def user_dir() -> Path:
    """Where user profiles (and ``boostlr calibrate``'s ``local.toml``) live."""
    if os.environ.get("BOOSTLR_HARDWARE"):
        return Path(os.environ["BOOSTLR_HARDWARE"]).expanduser()
    cache = os.environ.get("BOOSTLR_CACHE") or Path.home() / ".cache" / "boostlr"
    return Path(cache).expanduser() / "hardware"


def _shipped() -> dict[str, str]:
    folder = resources.files("boostlr") / "hardware"
    return {
        p.name.removesuffix(".toml"): p.read_text()
        for p in folder.iterdir()
        if p.name.endswith(".toml")
    }


def available() -> list[str]:
    names = set(_shipped())
    if user_dir().is_dir():
        names |= {p.stem for p in user_dir().glob("*.toml")}
    return sorted(names)


def load_profile(name: str) -> HardwareProfile:
    """A profile by name (user dir first, then shipped) or by path to a ``.toml`` file."""
    path = Path(name).expanduser()
    if name.endswith(".toml"):
        if not path.is_file():
            raise ConfigError(f"hardware profile file {path} does not exist")
        text, where = path.read_text(), str(path)
    elif (user_dir() / f"{name}.toml").is_file():
        where = str(user_dir() / f"{name}.toml")
        text = Path(where).read_text()
    elif name in _shipped():
        text, where = _shipped()[name], f"{name} (shipped)"
    else:
        hint = " (run `boostlr calibrate` first)" if name == "local" else ""
        raise ConfigError(
            f"unknown hardware profile '{name}'{hint}: choose one of "
            f"{', '.join(available()) or 'none'} or pass a .toml file"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"hardware profile {where} is not valid TOML: {exc}") from None
    return profile_from_dict(data, where)


def as_dict(hw: HardwareProfile) -> dict[str, Any]:
    """JSON-friendly summary (SI units)."""
    out = asdict(hw)
    out.pop("extra")
    return out
