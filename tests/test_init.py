"""The counter-based init: Philox's known answers, slices equal to the whole, the CoLA
distributions, and every layout's shards equal to the one-device init bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import rank_device, run_distributed
from parallel_cases import full_value, layout_config

from boostlr.config import build_config
from boostlr.models.init import init_rule, initial_value
from boostlr.models.llama import build_model
from boostlr.models.lowrank import cola_std
from boostlr.models.philox import normal_box, normal_from_words, philox4x32, stream_key
from boostlr.parallel.engine import ParallelModel

# Random123's kat_vectors for Philox4x32-10: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(counter, key, expected) -> None:
    words = [torch.tensor([c], dtype=torch.int64) for c in counter]
    assert tuple(int(w) for w in philox4x32(words, key)) == expected


@pytest.mark.parametrize(
    ("shape", "box"),
    [
        ((37, 53), [(5, 20), (3, 17)]),  # unaligned columns: gathered from a wider draw
        ((64, 128), [(0, 64), (32, 64)]),  # a tp column shard, aligned
        ((64, 128), [(16, 48), (0, 128)]),  # a row shard: one contiguous run
        ((7, 5, 6), [(1, 6), (2, 3), (1, 5)]),  # any rank
        ((1000,), [(333, 667)]),
        ((9, 4), [(3, 3), (0, 4)]),  # empty
    ],
)
def test_a_box_equals_the_whole_tensors_slice(shape, box) -> None:
    key = stream_key("test", 0, "w")
    whole = normal_box(key, shape)
    part = normal_box(key, shape, box)
    expected = whole[tuple(slice(a, b) for a, b in box)]
    assert part.shape == expected.shape and torch.equal(part, expected)


def test_long_runs_in_pieces_equal_one_draw(monkeypatch) -> None:
    """A run longer than a chunk is drawn in pieces; the pieces meet without a seam."""
    key = stream_key("test", 1, "w")
    whole = normal_box(key, (3, 4099))
    assert torch.equal(normal_box(key, (3, 4099), chunk=16), whole)
    box = [(1, 3), (5, 4001)]
    assert torch.equal(normal_box(key, (3, 4099), box, chunk=16), whole[1:3, 5:4001])


def test_inverse_cdf_matches_torch_ndtri() -> None:
    """Within float32 rounding of the exact quantile of the uniform each word stands for."""
    words = torch.randint(0, 2**32, (200_000,), dtype=torch.int64)
    words[:4] = torch.tensor([0, 1, 2**32 - 1, 2**32 - 2])
    z = normal_from_words(words).double()
    q = (((words >> 8) - 2**23).double() + 0.5) * 2.0**-24  # the central region's uniform
    tail = q.abs() > 0.425
    exact = torch.special.ndtri((words.double() + 0.5) * 2.0**-32)
    ref = torch.where(tail, exact, torch.special.ndtri(q + 0.5))
    assert ((z - ref).abs() / ref.abs()).max() < 5e-7
    assert tail.any() and (~tail).any()
    assert z.abs().max() > 6.0  # the extreme words reach 6.2 sigma
    assert torch.equal(z[:2], -z[2:4])  # symmetric


def test_normals_have_mean_zero_std_one_and_gaussian_quantiles() -> None:
    n = 1 << 20
    z = normal_box(stream_key("test", 2, "stats"), (n,)).double()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 5 / math.sqrt(2 * n)
    probs = torch.tensor([0.001, 0.02, 0.16, 0.5, 0.84, 0.98, 0.999], dtype=torch.float64)
    emp = torch.quantile(z[: 1 << 16], probs)  # quantile caps its input size
    assert torch.allclose(emp, torch.special.ndtri(probs), atol=0.06)
    # Neighbouring elements (one Philox block) are uncorrelated.
    assert abs((z[0::4] * z[1::4]).mean().item()) < 5 / math.sqrt(n / 4)


def test_cola_factors_keep_their_init_std() -> None:
    cfg = build_config(overrides=[("model.preset", "small"), ("model.arch", "cola")]).model
    cfg.vocab_size = 256
    model = build_model(cfg, seed=5)
    for name, p in model.named_parameters():
        rule = init_rule(cfg, name)
        if name.endswith(".down.weight"):
            assert rule == cola_std(*_dims(cfg, name), cfg.rank)
        if isinstance(rule, float) and p.numel() >= 4096:
            assert abs(p.std().item() / rule - 1) < 6 / math.sqrt(2 * p.numel()), name
            assert abs(p.mean().item()) < 6 * rule / math.sqrt(p.numel()), name
        elif rule == "ones":
            assert torch.equal(p, torch.ones_like(p))


def _dims(cfg, name):
    from boostlr.models.shapes import linear_shapes

    return linear_shapes(cfg)[name.split(".")[3]]


def test_seeds_and_names_give_independent_values() -> None:
    cfg = build_config(overrides=[("model.preset", "tiny")]).model
    cfg.vocab_size = 64
    name = "layers.0.attn.q_proj.down.weight"
    a = initial_value(cfg, name, (32, 64), seed=0)
    assert torch.equal(a, initial_value(cfg, name, (32, 64), seed=0))
    assert not torch.equal(a, initial_value(cfg, name, (32, 64), seed=1))
    other = initial_value(cfg, "layers.1.attn.q_proj.down.weight", (32, 64), seed=0)
    assert abs(torch.corrcoef(torch.stack([a.flatten(), other.flatten()]))[0, 1]) < 0.1


def _shards_equal_one_device(rank: int, world: int, cases) -> dict:
    """Every parameter of every layout, gathered from its shards, against build_model.

    Under NCCL the shards are drawn on the GPUs and still equal the CPU's draws.
    """
    out = {}
    for label, cfg in cases:
        model = ParallelModel.build(cfg, rank_device(rank))
        ref = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
        names = []
        for name, p in model.named_parameters():
            if not torch.equal(full_value(p).cpu(), ref[name].detach()):
                raise AssertionError(f"{label}: {name} differs from the one-device init")
            names.append(name)
        out[label] = names
    return out


@pytest.mark.slow
def test_every_layouts_shards_are_the_one_device_init_bit_for_bit() -> None:
    """tp2 and pp2 (2 ranks), dp2 x tp2 with the vocabulary split over dp (4 ranks)."""
    two = [
        ("tp2 cola btp", layout_config("cola", "btp", 1, 1, 2)),
        ("tp2 full megatron", layout_config("full", "megatron", 1, 1, 2)),
        ("pp2 lax btp", layout_config("lax", "btp", 2, 1, 1)),
    ]
    per_rank = run_distributed(_shards_equal_one_device, 2, two, timeout_s=600)
    pp = [set(r["pp2 lax btp"]) for r in per_rank]
    assert pp[0] and pp[1] and not pp[0] & pp[1]  # the stages hold different parameters
    four = [
        ("dp2tp2 cola btp vocab-dp", layout_config("cola", "btp", 1, 2, 2)),
        ("dp2tp2 full megatron vocab-dp", layout_config("full", "megatron", 1, 2, 2)),
        ("pp2tp2 svd vanilla", layout_config("svd", "vanilla", 2, 1, 2)),
    ]
    per_rank = run_distributed(_shards_equal_one_device, 4, four, timeout_s=600)
    assert all(r["dp2tp2 cola btp vocab-dp"] for r in per_rank)
