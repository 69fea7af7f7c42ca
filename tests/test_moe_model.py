"""The MoE MLP on one device, checked against a plain per-token, per-expert loop.

The loop (:func:`loop_reference`) runs in float64 on a copy of the module, one token and
one chosen expert at a time, with the design notes' formulas written out; the module runs
in fp32, so the two differ by fp32 rounding only. ``latent`` dispatch is also checked
against what the design says it equals: a MoE of whole CoLA MLPs whose outer factors are tied.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from fp32_noise import layout_bound
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from boostlr.config import ModelConfig, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.models import moe_dispatch
from boostlr.models.llama import build_model
from boostlr.models.moe import (
    MoEMLP,
    Routing,
    balance_loss,
    make_moe_mlp,
    moe_layers,
    update_expert_biases,
)
from boostlr.models.moe_routing import top_k_routing
from boostlr.specs.moe import capacity_of

TOL = 2e-5  # max |fp32 - float64| / max |float64|; a wrong formula is off by O(1)


def top_k(route: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k router's map as ``(idx, weights) [tokens, k]`` (its copies are choice-major)."""
    k = route.copies // route.tokens
    return route.expert.view(k, -1).t(), route.weight.view(k, -1).t()


def moe_cfg(**kw) -> ModelConfig:
    base = dict(
        preset="tiny", dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, n_layers=2, rank=4,
        moe_experts=4, moe_top_k=2, moe_ffn_dim=8, vocab_size=32,
    )  # fmt: skip
    cfg = resolve_model(ModelConfig(**{**base, **kw}))
    validate_moe(cfg)
    return cfg


def build(cfg: ModelConfig, seed: int, layer: int = 1) -> MoEMLP:
    """A MoE layer with random weights of unit-scale outputs and a random selection bias."""
    m = make_moe_mlp(cfg, layer)
    assert m is not None
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        if hasattr(m.router, "expert_bias"):
            m.router.expert_bias.copy_(0.2 * torch.randn(cfg.moe_experts, generator=gen))
    return m


def act(x: torch.Tensor, on: bool) -> torch.Tensor:
    return F.silu(x) if on else x


def expert_linear(module, x: torch.Tensor, e: int, arch: str) -> torch.Tensor:
    """Expert ``e``'s copy of one block linear on one token, from the stacked weights."""
    if arch == "full":
        return module.weight[e] @ x
    return module.up.weight[e] @ act(module.down.weight[e] @ x, arch != "svd")


def product(g: torch.Tensor, u: torch.Tensor, form: str) -> torch.Tensor:
    return F.silu(g) * u if form == "swiglu" else g * u


def latent_expert(ex, e: int, zg: torch.Tensor, zu: torch.Tensor, cfg: ModelConfig):
    """``σ(A_d^e ((B_g^e z_g) ⊙ (B_u^e z_u)))`` for one token."""
    h = product(ex.gate_proj.up.weight[e] @ zg, ex.up_proj.up.weight[e] @ zu, cfg.mlp_form)
    return act(ex.down_proj.down.weight[e] @ h, cfg.arch != "svd")


def whole_expert(ex, e: int, xt: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Expert ``e`` as a whole MLP of the arch, for one token."""
    g = expert_linear(ex.gate_proj, xt, e, cfg.arch)
    u = expert_linear(ex.up_proj, xt, e, cfg.arch)
    return expert_linear(ex.down_proj, product(g, u, cfg.mlp_form), e, cfg.arch)


def outer_latents(m: MoEMLP, xt: torch.Tensor, prev: dict | None, cfg: ModelConfig):
    """``σ(A_g x), σ(A_u x)`` for one token (LaX: through its crossing)."""
    zs = []
    for name in ("gate_proj", "up_proj"):
        part = getattr(m, name)
        a = part.down.weight @ xt
        if hasattr(part, "cross"):
            zs.append(F.silu(part.cross(a, None if prev is None else prev[name])[0]))
        else:
            zs.append(act(a, cfg.arch != "svd"))
    return zs


def loop_reference(
    m: MoEMLP, cfg: ModelConfig, x: torch.Tensor, z_prev: dict | None
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], int]:
    """(y, aux, choices, dropped): the MoE layer token by token, expert by expert."""
    b, s, _ = x.shape
    E, k = cfg.moe_experts, cfg.moe_top_k
    tokens = [(bi, si) for bi in range(b) for si in range(s)]
    choices, scores, weights = [], [], []
    for bi, si in tokens:  # routing
        logits = m.router.weight @ x[bi, si]
        if cfg.moe_balance == "bias":
            sig = torch.sigmoid(logits)
            normed = sig / sig.sum()
            key = (sig + m.router.expert_bias).tolist()
        else:
            normed = torch.softmax(logits, 0)
            key = normed.tolist()
        chosen = sorted(range(E), key=lambda i: -key[i])[:k]
        choices.append(chosen)
        scores.append(normed)
        weights.append(normed[chosen] / normed[chosen].sum())
    kept = [[True] * k for _ in tokens]
    if cfg.moe_capacity:
        capacity = math.ceil(cfg.moe_capacity * len(tokens) * k / E)
        kept = kept_by_hand(choices, E, capacity)
    rows = []
    for t, (bi, si) in enumerate(tokens):  # experts, one kept copy at a time
        xt, w = x[bi, si], weights[t]
        copies = [(j, e) for j, e in enumerate(choices[t]) if kept[t][j]]
        if m.latent:
            prev = None if z_prev is None else {n: v[bi, si] for n, v in z_prev.items()}
            zg, zu = outer_latents(m, xt, prev, cfg)
            acc = x.new_zeros(cfg.rank)
            for j, e in copies:
                acc = acc + w[j] * latent_expert(m.experts, e, zg, zu, cfg)
            for e in range(cfg.moe_shared):
                acc = acc + latent_expert(m.shared, e, zg, zu, cfg)
            rows.append(m.down_proj.up.weight @ acc)
        else:
            y = x.new_zeros(cfg.dim)
            for j, e in copies:
                y = y + w[j] * whole_expert(m.experts, e, xt, cfg)
            for e in range(cfg.moe_shared):
                y = y + whole_expert(m.shared, e, xt, cfg)
            rows.append(y)
    aux = x.new_zeros(())
    for bi in range(b):  # sequence-level balance loss, straight from its definition
        seq = range(bi * s, (bi + 1) * s)
        f = [E / (k * s) * sum(i in choices[t] for t in seq) for i in range(E)]
        p = [sum(scores[t][i] for t in seq) / s for i in range(E)]
        aux = aux + sum(f[i] * p[i] for i in range(E)) / b
    coef = cfg.moe_aux_coef if cfg.moe_balance == "aux" else 0.0
    dropped = sum(not c for row in kept for c in row)
    return torch.stack(rows).view(b, s, -1), coef * aux, choices, dropped


def kept_by_hand(idx: list[list[int]], experts: int, capacity: int) -> list[list[bool]]:
    """First choices before second ones, earlier tokens first; past capacity is dropped."""
    used = [0] * experts
    kept = [[False] * len(idx[0]) for _ in idx]
    for j in range(len(idx[0])):
        for t, row in enumerate(idx):
            kept[t][j] = used[row[j]] < capacity
            used[row[j]] += 1
    return kept


def payload_of(m: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """What the layer routes for ``x [tokens, d]``: x itself, or ``[σ(A_g x) | σ(A_u x)]``."""
    if not m.latent:
        return x
    return torch.cat([F.silu(m.gate_proj.down(x)), F.silu(m.up_proj.down(x))], -1)


def rel(a: torch.Tensor, exact: torch.Tensor, floor: float = 1e-4) -> float:
    """``max |a - exact| / max |exact|``; a gradient that is zero in exact arithmetic (the
    router's when each token's weights are always 1 or equal) is measured against ``floor``,
    the size of the gradients whose rounding it collects."""
    exact = exact.double()
    return ((a.double() - exact).abs().max() / exact.abs().max().clamp_min(floor)).item()


def check_against_loop(cfg: ModelConfig, seed: int, b: int, s: int) -> None:
    m = build(cfg, seed)
    ref = copy.deepcopy(m).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, s, cfg.dim, generator=gen)
    up = torch.randn(b, s, cfg.dim, generator=gen)
    z_prev = None
    if cfg.arch == "lax":
        z_prev = {n: torch.randn(b, s, cfg.rank, generator=gen) for n in ("gate_proj", "up_proj")}
    xr = x.double().requires_grad_()
    zr = None if z_prev is None else {n: t.double() for n, t in z_prev.items()}
    y_ref, aux_ref, choices, dropped = loop_reference(ref, cfg, xr, zr)
    # Near-ties between the fp32 and float64 selections are not what this test is about.
    for row in torch.sigmoid(ref.router.weight.detach() @ xr.detach().reshape(-1, cfg.dim).T).T:
        gaps = (row[:, None] - row[None, :]).abs() + torch.eye(len(row), dtype=row.dtype)
        assume(cfg.moe_balance == "aux" or bool(gaps.min() > 1e-4))
    ((y_ref * up.double()).sum() + aux_ref).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    # A gradient that is zero in exact arithmetic is measured against the largest one, as
    # fp32_noise's floor is a few ulps of the largest gradient element.
    floor = max(g.abs().max().item() for g in grads.values())
    exact = [y_ref.detach(), aux_ref.detach(), xr.grad, grads]
    noise = fp32_errors(copy.deepcopy(m), cfg, (x, z_prev, up), exact, floor, choices)
    tol = layout_bound(max(noise))
    xm = x.clone().requires_grad_()
    y, _ = m(xm, z_prev)
    assert top_k(m.router(xm.detach().reshape(-1, cfg.dim)))[0].tolist() == choices
    if cfg.moe_capacity:
        assert m.dropped.item() == dropped
    (y * up).sum().backward()  # the balance loss's gradient is added by the layer itself
    for name, err in errors_of(m, y, m.aux_loss, xm.grad, cfg, exact, floor):
        assert err < tol, (name, err, tol)


def errors_of(m, y, aux, x_grad, cfg, exact, floor) -> list[tuple[str, float]]:
    """Each quantity's error against the float64 loop: output, balance loss, input and
    parameter gradients."""
    y_ref, aux_ref, x_grad_ref, grads = exact
    out = [("y", rel(y.detach(), y_ref)), ("x.grad", rel(x_grad, x_grad_ref))]
    if cfg.moe_balance == "aux":
        out.append(("aux", abs(aux.item() - aux_ref.item()) / abs(aux_ref.item())))
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        out.append((name, rel(p.grad, grads[name], floor)))
    return out


def fp32_errors(m32, cfg, inputs, exact, floor, choices) -> list[float]:
    """The loop reference's own errors when it runs in fp32: the CPU's noise on these very
    sums, which bounds the layer's (``layout_bound``), so a case that rounds badly is no
    failure while a wrong formula stays off by O(1)."""
    x, z_prev, up = inputs
    x32 = x.clone().requires_grad_()
    y32, aux32, choices32, _ = loop_reference(m32, cfg, x32, z_prev)
    assume(choices32 == choices)  # a near-tie fp32 breaks the other way: not this test's
    ((y32 * up).sum() + aux32).backward()
    return [err for _, err in errors_of(m32, y32, aux32, x32.grad, cfg, exact, floor)]


@settings(max_examples=60, deadline=None)
@given(
    arch=st.sampled_from(["cola", "svd", "lax", "full"]),
    hidden=st.booleans(),
    balance=st.sampled_from(["bias", "aux"]),
    experts=st.integers(1, 5),
    top_k=st.integers(1, 5),
    shared=st.integers(0, 2),
    swiglu=st.booleans(),
    capacity=st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5]),
    b=st.integers(1, 3),
    s=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_forward_backward_match_the_loop(
    arch, hidden, balance, experts, top_k, shared, swiglu, capacity, b, s, seed
) -> None:
    dispatch = "hidden" if arch == "full" or (hidden and arch != "lax") else "latent"
    cfg = moe_cfg(
        arch=arch,
        moe_dispatch=dispatch,
        moe_balance=balance,
        moe_experts=experts,
        moe_top_k=min(top_k, experts),
        moe_shared=shared,
        mlp="swiglu" if swiglu or arch == "full" else "lowrank-only",
        moe_aux_coef=0.3,
        moe_capacity=capacity,
    )
    check_against_loop(cfg, seed, b, s)


@pytest.mark.parametrize("arch", ["cola", "svd"])
@pytest.mark.parametrize("form", ["lowrank-only", "swiglu"])
def test_latent_equals_whole_mlps_with_tied_outer_factors(arch: str, form: str) -> None:
    """§9's claim: latent dispatch is the MoE of whole CoLA MLPs sharing A_g, A_u and B_d."""
    cfg = moe_cfg(arch=arch, mlp=form, moe_shared=2, moe_dispatch="latent")
    latent = build(cfg, seed=3)
    whole = make_moe_mlp(moe_cfg(arch=arch, mlp=form, moe_shared=2, moe_dispatch="hidden"), 1)
    with torch.no_grad():
        whole.router.weight.copy_(latent.router.weight)
        whole.router.expert_bias.copy_(latent.router.expert_bias)
        for name in ("experts", "shared"):
            lat, wh = getattr(latent, name), getattr(whole, name)
            wh.gate_proj.down.weight.copy_(
                latent.gate_proj.down.weight.expand_as(wh.gate_proj.down.weight)
            )
            wh.up_proj.down.weight.copy_(
                latent.up_proj.down.weight.expand_as(wh.up_proj.down.weight)
            )
            wh.down_proj.up.weight.copy_(
                latent.down_proj.up.weight.expand_as(wh.down_proj.up.weight)
            )
            wh.gate_proj.up.weight.copy_(lat.gate_proj.up.weight)
            wh.up_proj.up.weight.copy_(lat.up_proj.up.weight)
            wh.down_proj.down.weight.copy_(lat.down_proj.down.weight)
    x = torch.randn(2, 7, cfg.dim, generator=torch.Generator().manual_seed(9))
    y_lat, _ = latent(x, None)
    y_whole, _ = whole(x, None)
    assert rel(y_lat, y_whole) < TOL
    y_lat.square().sum().backward()
    y_whole.square().sum().backward()
    for name in ("experts", "shared"):  # each expert's own factors: the same gradient
        lat, wh = getattr(latent, name), getattr(whole, name)
        assert rel(lat.gate_proj.up.weight.grad, wh.gate_proj.up.weight.grad) < TOL
        assert rel(lat.down_proj.down.weight.grad, wh.down_proj.down.weight.grad) < TOL
    for outer, factor in (("gate_proj", "down"), ("up_proj", "down"), ("down_proj", "up")):
        tied = sum(
            getattr(getattr(getattr(whole, n), outer), factor).weight.grad.sum(0)
            for n in ("experts", "shared")
        )  # a tied factor's gradient is the sum of its copies'
        assert rel(getattr(getattr(latent, outer), factor).weight.grad, tied) < TOL


@pytest.mark.parametrize("balance", ["bias", "aux"])
@pytest.mark.parametrize("dispatch", ["latent", "hidden"])
def test_all_experts_with_equal_scores_average(balance: str, dispatch: str) -> None:
    cfg = moe_cfg(moe_top_k=4, moe_balance=balance, moe_dispatch=dispatch, moe_shared=1)
    m = build(cfg, seed=5)
    with torch.no_grad():
        m.router.weight.zero_()
        if balance == "bias":
            m.router.expert_bias.zero_()
    x = torch.randn(3, 4, cfg.dim)
    route = m.router(x.reshape(-1, cfg.dim))
    assert torch.equal(top_k(route)[1], torch.full((12, 4), 0.25))
    y, _ = m(x, None)
    payload = payload_of(m, x.reshape(-1, cfg.dim))
    inner = m.experts(payload, None).mean(0) + m.shared(payload, None).sum(0)
    expected = m.down_proj.up(inner) if m.latent else inner
    assert rel(y.detach(), expected.detach().view(3, 4, -1)) < TOL


@pytest.mark.parametrize("dispatch", ["latent", "hidden"])
def test_capacity_drops_are_counted_and_deterministic(dispatch: str) -> None:
    cfg = moe_cfg(moe_capacity=0.5, moe_dispatch=dispatch, moe_shared=1)
    m = build(cfg, seed=11)
    with torch.no_grad():  # crowd expert 0 so that it overflows
        m.router.expert_bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))
    x = torch.randn(2, 8, cfg.dim, generator=torch.Generator().manual_seed(2))
    y, _ = m(x, None)
    route = m.router(x.reshape(-1, cfg.dim))
    capacity = capacity_of(16, 2, 4, 0.5)
    idx, weights = top_k(route)
    kept = kept_by_hand(idx.tolist(), 4, capacity)
    dropped = sum(not k for row in kept for k in row)
    assert dropped > 0 and m.dropped.item() == dropped
    # The same layer without capacity, with the dropped copies' weights zeroed.
    mask = torch.tensor(kept, dtype=weights.dtype)
    payload = payload_of(m, x.reshape(-1, cfg.dim))
    masked = top_k_routing(idx, weights * mask, route.scores)
    out = moe_dispatch.dropless(payload, masked, 4, m.experts)
    out = out + m.shared(payload, None).sum(0)
    expected = m.down_proj.up(out) if m.latent else out
    assert rel(y.detach(), expected.detach().view(2, 8, -1)) < TOL
    y2, _ = m(x, None)
    assert torch.equal(y, y2) and m.dropped.item() == dropped


def test_enough_capacity_equals_dropless() -> None:
    cfg = moe_cfg()
    m = build(cfg, seed=4)
    x = torch.randn(2, 6, cfg.dim)
    y, _ = m(x, None)
    m.capacity = 2.0  # E / k: room for every copy even if all go to one expert
    y_cap, _ = m(x, None)
    assert m.dropped.item() == 0
    assert rel(y_cap, y) < TOL


def test_dropless_reads_nothing_back_where_the_grouped_kernel_runs(monkeypatch) -> None:
    """ep 1 dropless runs the experts as grouped GEMMs on device offsets: no host read.
    The padded fallback (float64 here, which the grouped kernel does not take) reads the
    busiest expert's count once per layer; a capacity never reads anything."""
    calls = []
    real = moe_dispatch.host_counts
    monkeypatch.setattr(moe_dispatch, "host_counts", lambda c: calls.append(1) or real(c))
    m = build(moe_cfg(), seed=1)
    x = torch.randn(2, 3, 16)
    m(x, None)
    assert calls == []
    m.double()(x.double(), None)
    assert len(calls) == 1
    m.capacity = 1.0
    m(x.double(), None)
    assert len(calls) == 1  # fixed shapes: no copy


def test_bias_balance_counts_updates_and_stays_a_buffer() -> None:
    cfg = moe_cfg(moe_bias_rate=0.01)
    m = build(cfg, seed=8)
    assert "router.expert_bias" in m.state_dict() and "router.load" not in m.state_dict()
    assert "router.expert_bias" not in dict(m.named_parameters())
    before = m.router.expert_bias.clone()
    x = torch.randn(4, 5, cfg.dim)
    m.eval()
    m(x, None)
    assert m.router.load.sum().item() == 0  # evaluation does not count
    m.train()
    y, _ = m(x, None)
    y.sum().backward()
    idx = m.router(x.reshape(-1, cfg.dim)).expert
    load = torch.bincount(idx, minlength=4)
    assert torch.equal(m.router.load, load)
    assert m.router.expert_bias.grad is None and not m.router.expert_bias.requires_grad
    update_expert_biases(moe_layers(m))
    mean = load.double().mean()
    expected = before + 0.01 * torch.sign(mean - load.double()).float()
    assert torch.equal(m.router.expert_bias, expected)
    assert m.router.load.sum().item() == 0


def test_balance_loss_by_hand() -> None:
    # One sequence of two tokens, two experts, one choice each: f = E/(k s) x counts.
    scores = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    apart = top_k_routing(torch.tensor([[0], [1]]), torch.ones(2, 1), scores)
    assert balance_loss(apart, torch.Size([1, 2]), 2).item() == pytest.approx(1.0)
    together = top_k_routing(torch.tensor([[0], [0]]), torch.ones(2, 1), scores)
    # f = [2, 0], P = [0.55, 0.45]
    assert balance_loss(together, torch.Size([1, 2]), 2).item() == pytest.approx(1.1)


def test_aux_gradient_follows_the_loss_scale() -> None:
    cfg = moe_cfg(moe_balance="aux", moe_aux_coef=0.5)
    grads = []
    for scale in (1.0, 0.25):
        m = build(cfg, seed=6)
        m.aux_scale = scale
        y, _ = m(torch.randn(2, 5, cfg.dim, generator=torch.Generator().manual_seed(0)), None)
        (y * 0).sum().backward()  # only the balance loss's gradient remains
        grads.append(m.router.weight.grad)
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[1], 0.25 * grads[0], rtol=1e-6, atol=0)


def test_bf16_autocast_routes_in_fp32() -> None:
    cfg = moe_cfg()
    m = build(cfg, seed=2)
    x = torch.randn(2, 5, cfg.dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(x, None)
        route = m.router(x.reshape(-1, cfg.dim))
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y.float()).all())
    assert route.weight.dtype == torch.float32
    assert torch.equal(route.expert, m.router(x.reshape(-1, cfg.dim)).expert)


def _bias_after_step(rank: int, world: int) -> tuple[list[int], list[float]]:
    import torch.distributed as dist

    m = build(moe_cfg(moe_bias_rate=0.01), seed=8)
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(100 + rank))
    m(x, None)[0].sum().backward()
    load = m.router.load.tolist()
    update_expert_biases([m], group=dist.group.WORLD)
    return load, m.router.expert_bias.tolist()


def test_bias_update_is_equal_on_every_rank() -> None:
    """Ranks that saw different tokens sum their loads first, so every bias moves alike."""
    (load0, bias0), (load1, bias1) = run_distributed(_bias_after_step, 2)
    assert load0 != load1 and bias0 == bias1
    total = torch.tensor(load0) + torch.tensor(load1)
    start = build(moe_cfg(), seed=8).router.expert_bias
    expected = start + 0.01 * torch.sign(total.double().mean() - total.double()).float()
    assert bias0 == expected.tolist()


@pytest.mark.parametrize("arch", ["cola", "lax", "full"])
def test_moe_blocks_train_inside_the_model(arch: str) -> None:
    """The layer drops into a block in place of the dense MLP (its latents included)."""
    cfg = moe_cfg(arch=arch, n_layers=3, moe_dense_layers=1, moe_shared=1, moe_capacity=1.0)
    if arch == "full":
        cfg.mlp = "swiglu"
    model = build_model(cfg, seed=0)
    for i, block in model.layers.items():
        mlp = make_moe_mlp(cfg, int(i))
        if mlp is not None:
            block.mlp = build(cfg, seed=int(i), layer=int(i))
    assert len(moe_layers(model)) == 2
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    named = dict(model.named_parameters())
    assert all(named[n].grad is not None for n in named if ".router." in n or ".experts." in n)
    assert "layers.1.mlp.router.expert_bias" in model.state_dict()
