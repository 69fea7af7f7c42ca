"""Model shapes, parameter/FLOP formulas, meta-device presets and initialisation."""

from __future__ import annotations

import pytest
import torch

from boostlr.config import PRESETS, ModelConfig, build_config, resolve_model
from boostlr.models.counting import count_params, flops_per_token
from boostlr.models.llama import build_model
from boostlr.models.lowrank import DenseLinear, LaxLinear, LowRankLinear, cola_std

ARCHS = ("full", "cola", "svd", "lax")


def model_cfg(arch: str, preset: str = "tiny", vocab: int = 256, **extra: str) -> ModelConfig:
    overrides = [("model.preset", preset), ("model.arch", arch)]
    overrides += [(f"model.{k}", str(v)) for k, v in extra.items()]
    cfg = build_config(overrides=overrides).model
    cfg.vocab_size = vocab
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_shapes_and_param_count(arch: str) -> None:
    cfg = model_cfg(arch, n_kv_heads=2)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    assert model(tokens).shape == (2, 12, cfg.vocab_size)
    loss = model(tokens, tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
    k_proj = model.layers["0"].self_attn.k_proj
    if arch == "full":
        assert isinstance(k_proj, DenseLinear) and k_proj.weight.shape == (cfg.kv_dim, cfg.dim)
    else:
        assert isinstance(k_proj, LowRankLinear)
        assert k_proj.down.weight.shape == (cfg.rank, cfg.dim)
        assert k_proj.up.weight.shape == (cfg.kv_dim, cfg.rank)
    if arch == "lax":
        assert isinstance(k_proj, LaxLinear)
        assert not hasattr(k_proj.cross, "gate_down")  # block 0: no crossing
        assert hasattr(model.layers["1"].self_attn.k_proj.cross, "gate_down")


def test_cola_7b_parameter_count_matches_formula() -> None:
    cfg = model_cfg("cola", preset="7B", vocab=32000)
    d, f, r, L, V = 4096, 11008, 1024, 32, 32000
    assert cfg.rank == r  # default rank_ratio 0.25
    per_block = r * (d + d) * 3 + r * (d + d) + 2 * r * (d + f) + r * (f + d) + 2 * d
    assert count_params(cfg).total == L * per_block + 2 * V * d + d
    meta = build_model(cfg, device="meta")
    assert sum(p.numel() for p in meta.parameters()) == count_params(cfg).total


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_preset_builds_on_meta(preset: str, arch: str) -> None:
    cfg = model_cfg(arch, preset=preset, vocab=PRESETS[preset].vocab_size)
    model = build_model(cfg, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


def test_flops_per_token_formula() -> None:
    cfg = model_cfg("full", preset="60M", vocab=32000)
    d, f, L, V, s = 512, 1376, 8, 32000, 256
    matmul = L * (4 * d * d + 3 * d * f) + V * d
    assert flops_per_token(cfg, s) == 6 * matmul + 12 * L * d * s


def test_lowrank_reduces_params() -> None:
    full, cola = model_cfg("full", preset="1B"), model_cfg("cola", preset="1B")
    assert count_params(cola).non_embedding < 0.6 * count_params(full).non_embedding


def test_init_is_seeded_and_cola_scaled() -> None:
    cfg = model_cfg("cola", preset="60M")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    down = a.layers["0"].mlp.gate_proj.down.weight
    expected = cola_std(cfg.dim, cfg.ffn_dim, cfg.rank)
    assert abs(down.std().item() - expected) < 0.05 * expected
    c = build_model(cfg, seed=4)
    assert not torch.equal(c.embed_tokens.weight, a.embed_tokens.weight)


def test_svd_is_linear_and_cola_is_not() -> None:
    torch.manual_seed(0)
    svd = LowRankLinear(8, 6, 3, activation=False)
    cola = LowRankLinear(8, 6, 3, activation=True)
    cola.load_state_dict(svd.state_dict())
    x = torch.randn(4, 8)
    assert torch.allclose(svd(2 * x)[0], 2 * svd(x)[0], atol=1e-6)
    assert not torch.allclose(cola(2 * x)[0], 2 * cola(x)[0], atol=1e-3)
    assert torch.allclose(svd(x)[0], x @ (svd.up.weight @ svd.down.weight).T, atol=1e-6)


def test_lax_crossing_uses_previous_latent() -> None:
    cfg = model_cfg("lax", lax_gate="full")
    model = build_model(cfg, seed=0)
    for p in model.parameters():  # the gate starts at zero; make it matter
        p.data.add_(0.01 * torch.randn_like(p))
    tokens = torch.randint(0, cfg.vocab_size, (1, 8))
    x = model.embed_tokens(tokens)
    from boostlr.models.llama import rope_tables

    rope = rope_tables(cfg, 8)
    _, z0 = model.layers["0"](x, rope, None)
    out_with, _ = model.layers["1"](x, rope, z0)
    zeros = {k: torch.zeros_like(v) for k, v in z0.items()}
    out_without, _ = model.layers["1"](x, rope, zeros)
    assert not torch.allclose(out_with, out_without)


def test_tied_embeddings_share_storage() -> None:
    cfg = model_cfg("cola", tie_embeddings="true")
    model = build_model(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


def test_tiny_model_overfits_a_batch() -> None:
    cfg = model_cfg("cola", vocab=64)
    model = build_model(cfg, seed=0)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss = model(inputs, targets)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 4.0 and loss.item() < 0.5


def test_rank_resolution() -> None:
    m = resolve_model(ModelConfig(preset="7B", arch="cola", rank_ratio=0.5))
    assert m.rank == 2048
    m = resolve_model(ModelConfig(preset="7B", arch="svd", rank=100))
    assert m.rank == 100


def _plain_step(cfg: ModelConfig, grouping: bool, act_ckpt: str = "none"):
    """Loss and gradients of one forward/backward on one device."""
    from boostlr.parallel.collectives import CommLedger, GroupComm
    from boostlr.parallel.context import TPContext
    from boostlr.parallel.tensor_parallel import TensorParallelModel

    model = build_model(cfg, seed=2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # move every parameter off its init (LaX gates start at zero)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ctx = TPContext(GroupComm(None, "tp", CommLedger()), cfg, grouping=grouping, act_ckpt=act_ckpt)
    tp1 = TensorParallelModel(model, None, ctx)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = tp1(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ops = {e.key for e in prof.key_averages()}
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, ops


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("cola", {}),
        ("svd", {"n_kv_heads": 2}),
        ("lax", {"lax_gate": "full"}),
        ("cola", {"mlp": "swiglu"}),
    ],
)
def test_grouped_projections_at_tp1_equal_the_ungrouped_math(arch: str, extra: dict) -> None:
    """TP 1 runs BTP's grouped block (one GEMM per [A_q|A_k|A_v], bmm for same-shaped B's)."""
    cfg = model_cfg(arch, **extra)
    loss, grads, ops = _plain_step(cfg, grouping=True)
    ref_loss, ref_grads, ref_ops = _plain_step(cfg, grouping=False)
    assert "aten::bmm" in ops and "aten::bmm" not in ref_ops  # B_gate/B_up as one bmm
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        ref = ref_grads[name]
        assert (g - ref).abs().max() <= 2e-5 * ref.abs().max(), name
