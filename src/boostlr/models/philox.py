"""Counter-based normal draws: any box of a tensor, alone, on any device, same bits.

Element ``i`` (flat, row-major) of a tensor keyed by ``key`` is a pure function of
``(key, i)``: Philox4x32-10 (Salmon et al., SC'11; Random123's known-answer vectors in the
tests) of counter ``i // 4`` gives four 32-bit words, word ``i % 4`` becomes a uniform in
``(0, 1)`` and Wichura's inverse normal CDF (AS 241) turns it into a standard normal. So a
rank draws only the slice of a parameter it holds, and a slice equals the same slice of the
whole tensor bit for bit, whatever the layout.

Everything is plain torch on int64 and float64 tensors, using only operations that IEEE
rounds exactly (``+ - * /``, ``sqrt``, bit ops, ``frexp``): no ``log``/``sin`` kernels whose
vectorised and scalar paths (or CPU and CUDA) may differ in the last bit. The logarithm the
tails need is a series evaluated with those operations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (golden ratio, sqrt(3) - 1)

# Wichura's AS 241 (PPND7, single precision, relative error about 1e-7): positive
# coefficients, so float32 evaluates the central region without cancellation.
_A = (5.9109374720e01, 1.5929113202e02, 5.0434271938e01, 3.3871327179e00)
_B = (6.7187563600e01, 7.8757757664e01, 1.7895169469e01, 1.0)
_C = (1.7023821103e-01, 1.3067284816e00, 2.7568153900e00, 1.4234372777e00)
_D = (1.2021132975e-01, 7.3700164250e-01, 1.0)
_E = (1.7337203997e-02, 4.2868294337e-01, 3.0812263860e00, 6.6579051150e00)
_F = (1.2258202635e-02, 2.4197894225e-01, 1.0)
_SPLIT = 0.425


def stream_key(*parts: object) -> tuple[int, int, int, int]:
    """Four 32-bit words from ``parts``, the same on every machine and torch version.

    Two become Philox's key, two the high half of its counter: a 128-bit stream identity.
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4))


def philox4x32(
    counter: Sequence[Tensor | int], key: Sequence[int], rounds: int = 10
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-``rounds`` of a 128-bit counter (four 32-bit words; ``counter[0]`` a tensor).

    Products are taken in int64, which wraps modulo 2^64 on every torch backend: their low
    64 bits are exact, so both 32-bit halves are (the known-answer tests check this). Words
    carry junk above bit 31 between rounds; the mask is applied only where it matters, before
    a multiply and at the end.
    """
    c0, c1, c2, c3 = counter
    c2 = c2 if isinstance(c2, Tensor) else torch.full_like(c0, c2)
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = c0 * _M0, c2 * _M1  # lo words: p & MASK32, hi words: p >> 32
        c0 = (p1 >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(MASK32)
        c2 = (p0 >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(MASK32)
        c1, c3 = p1, p0
        k0, k1 = (k0 + _W0) & MASK32, (k1 + _W1) & MASK32
    return c0, c1 & MASK32, c2, c3 & MASK32


def _horner(coeffs: Sequence[float], x: Tensor) -> Tensor:
    """``coeffs[0] x^n + ... + coeffs[n]`` as separate multiplies and adds (no fused FMA)."""
    acc = x * coeffs[0]
    acc.add_(coeffs[1])
    for c in coeffs[2:]:
        acc.mul_(x).add_(c)
    return acc


def exact_log(x: Tensor) -> Tensor:
    """``log(x)`` of positive float64 ``x`` from IEEE-exact operations only.

    ``x = m 2^e`` with ``m`` in ``[sqrt(1/2), sqrt(2))``; ``log m = 2 atanh(s)``,
    ``s = (m - 1) / (m + 1)``, ``|s| < 0.172``: eleven terms of the odd series reach
    float64's precision.
    """
    m, e = torch.frexp(x)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1) / (m + 1)
    series = _horner([1 / (2 * k + 1) for k in range(10, -1, -1)], s * s)
    return e * math.log(2) + 2 * s * series


def normal_from_words(words: Tensor) -> Tensor:
    """Standard normals (float32) from 32-bit words (int64) by the inverse CDF.

    The central 85% (``|u - 1/2| <= 0.425``) runs in float32 on ``u - 1/2`` taken exactly
    from the word's top 24 bits; the tails run in float64 on all 32 bits (to 6.2 sigma).
    """
    flat = words.reshape(-1)
    q = ((flat >> 8) - (1 << 23)).to(torch.float32).add_(0.5).mul_(2.0**-24)  # exact
    r = (q * q).neg_().add_(_SPLIT * _SPLIT)
    z = _horner(_A, r).mul_(q).div_(_horner(_B, r))
    idx = (q.abs() > _SPLIT).nonzero().squeeze(1)
    if idx.numel():
        u = flat[idx].to(torch.float64).add_(0.5).mul_(2.0**-32)  # exact, in (0, 1)
        t = torch.sqrt(-exact_log(torch.minimum(u, 1 - u)))
        near = t <= 5
        t1, t2 = t - 1.6, t - 5
        zt = torch.where(near, _horner(_C, t1) / _horner(_D, t1), _horner(_E, t2) / _horner(_F, t2))
        z[idx] = torch.where(u < 0.5, -zt, zt).to(torch.float32)
    return z.view(words.shape)


def _words(first: Tensor, count: int, key: tuple[int, int, int, int]) -> Tensor:
    """``[len(first), 4 * count]`` words: counters ``first[r] .. first[r] + count - 1``."""
    n = first[:, None] + torch.arange(count, device=first.device, dtype=torch.int64)
    out = philox4x32((n & MASK32, n >> 32, key[2], key[3]), (key[0], key[1]))
    return torch.stack(out, dim=-1).reshape(first.shape[0], 4 * count)


def _collapse(
    shape: Sequence[int], box: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Merge a trailing whole dim into the one before it: fewer, longer runs."""
    shape, box = list(shape) or [1], list(box) or [(0, 1)]
    while len(shape) > 1 and box[-1] == (0, shape[-1]):
        n = shape.pop()
        box.pop()
        a, b = box[-1]
        box[-1] = (a * n, b * n)
        shape[-1] *= n
    return shape, box


# Counters per step of a draw: temporaries that stay in a CPU's cache. The caller that knows
# the device passes a larger chunk for a GPU (``boostlr.platform``'s ``draw_chunk_counters``);
# the chunk changes only the speed, never a value.
HOST_CHUNK_COUNTERS = 1 << 16


def normal_box(
    key: tuple[int, int, int, int],
    shape: Sequence[int],
    box: Sequence[tuple[int, int]] | None = None,
    std: float = 1.0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    chunk: int = HOST_CHUNK_COUNTERS,
) -> Tensor:
    """``std *`` standard normals of the elements of ``box`` (``(start, end)`` per dim).

    Equals ``normal_box(key, shape)[box]`` bit for bit, computed without the rest, whatever
    ``chunk`` (counters drawn per step) is.
    """
    box = [(0, n) for n in shape] if box is None else [tuple(r) for r in box]
    out = torch.empty([b - a for a, b in box], dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    shape2, box2 = _collapse(shape, box)
    strides = torch.empty(shape2, device="meta").stride()
    bases = torch.zeros(1, dtype=torch.int64, device=device)
    for (a, b), stride in zip(box2[:-1], strides[:-1], strict=True):
        rows = torch.arange(a, b, dtype=torch.int64, device=device) * stride
        bases = (bases[:, None] + rows[None, :]).flatten()
    start, end = box2[-1]
    width = end - start
    flat = out.view(-1, width)
    aligned = start % 4 == 0 and width % 4 == 0 and all(s % 4 == 0 for s in strides[:-1])
    per_step = max(1, chunk // (width // 4 + 2))  # rows per step
    for r0 in range(0, bases.shape[0], per_step):
        rows = bases[r0 : r0 + per_step] + start
        for c0 in range(0, width, 4 * chunk):  # a single very long run goes in pieces
            w = min(4 * chunk, width - c0)
            first = rows + c0
            if aligned:
                words = _words(first >> 2, w // 4, key)
            else:
                words = _words(first >> 2, (w + 6) // 4, key)  # covers any start & 3
                cols = (first & 3)[:, None] + torch.arange(w, device=first.device)
                words = torch.gather(words, 1, cols)
            flat[r0 : r0 + rows.shape[0], c0 : c0 + w] = normal_from_words(words).mul_(std)
    return out
