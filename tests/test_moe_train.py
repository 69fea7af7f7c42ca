"""The MoE MLP wired into the model, the trainer and every command that reads a config.

What runs (one device and data parallel) trains as one device does and resumes bit for bit;
what does not run yet (tp other than BTP's latent dispatch, BTP's region checkpointing, an
import of a LLaMA into experts) is refused in one line (BTP: tests/test_moe_btp*.py).
tests/test_moe_model.py checks the layer's math; tests/test_host_syncs.py counts its one
device-to-host copy per layer; tests/test_moe_export.py the HF export.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from parallel_cases import global_batch, layout_config, run_cases
from test_parallel_3d import assert_follows
from test_train import read_rows, tiny_run_config, train_rows

from boostlr.cli import main
from boostlr.config import ModelConfig, build_config, resolve_model
from boostlr.config.validate_moe import validate_moe
from boostlr.errors import ConfigError
from boostlr.evaluate import run_eval
from boostlr.export import export_checkpoint, load_pretrained
from boostlr.generate import generate
from boostlr.import_hf import import_config
from boostlr.models.counting import count_params
from boostlr.models.init import init_rule
from boostlr.models.llama import build_model
from boostlr.models.lowrank import cola_std
from boostlr.models.moe import MOE, MoEMLP, checkpointed_buffers, moe_layers
from boostlr.parallel.engine import ParallelModel
from boostlr.rundir.checkpoint import load_model_state, open_checkpoint
from boostlr.rundir.info import inspect_checkpoint
from boostlr.train import run as trainer

MOE_KEYS = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
BIAS = "layers.1.mlp.router.expert_bias"


def moe_run_config(data: Path, **extra: object):
    return tiny_run_config(data, **{**MOE_KEYS, **extra})


@pytest.fixture(scope="module")
def moe_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps of the tiny MoE model, global batch 8 as 4 x 2 micro-batches."""
    run = tmp_path_factory.mktemp("moe") / "run"
    trainer.train(moe_run_config(small_dataset, **{"train.grad_accum": 2}), run, console=False)
    return run


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"parallel.tp": 2, "parallel.tp_strategy": "vanilla"}, "runs under tp strategy btp"),
        ({"parallel.act_ckpt": "lowrank"}, "parallel.act_ckpt lowrank checkpoints BTP"),
        ({"parallel.tp_strategy": "btp", "model.moe_dispatch": "hidden"}, "hidden runs on"),
    ],
)
def test_layouts_moe_does_not_run_yet_are_refused(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, message
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        moe_run_config(small_dataset, **extra)
    args = ["train", "--run-dir", str(tmp_path / "run"), "--quiet", "--data.path"]
    args += [str(small_dataset)] + [f"--{k}={v}" for k, v in {**MOE_KEYS, **extra}.items()]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_import_hf_refuses_moe_in_one_line(tmp_path: Path) -> None:
    """(``boostlr plan`` covers MoE now: tests/test_moe_plan.py.)"""
    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    hf |= {"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    pairs = [(k, str(v)) for k, v in MOE_KEYS.items()]
    with pytest.raises(ConfigError, match="boostlr import-hf does not support MoE"):
        import_config(tmp_path, pairs)


def test_the_built_model_is_the_single_device_model() -> None:
    """The meta-device build draws every MoE parameter as the single-device init does (its
    own rule) and gives the buffers real zeros; the counts follow the real modules."""
    cfg = layout_config("cola", "auto", 1, 1, 1, **MOE_KEYS)
    built = ParallelModel.build(cfg, torch.device("cpu"))
    model = built.stages[0].model
    assert [m.kind for m in moe_layers(model)] == [MOE, MOE]
    ref = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in built.named_parameters())
    assert all(not b.is_meta and not b.any() for _, b in model.named_buffers())
    assert [n for n, _ in checkpointed_buffers(model)] == [
        "layers.0.mlp.router.expert_bias",
        BIAS,
    ]
    m, dense = cfg.model, layout_config("cola", "auto", 1, 1, 1)
    expert_sized = cola_std(m.dim, m.moe_ffn_dim, m.rank)  # d -> f_e, not the dense d -> ffn
    shared_in = "layers.0.mlp.gate_proj.down.weight"  # A_g, every expert's
    assert init_rule(m, "layers.0.mlp.experts.gate_proj.up.weight") == expert_sized
    assert init_rule(m, shared_in) == expert_sized != init_rule(dense.model, shared_in)
    assert checkpointed_buffers(build_model(dense.model)) == []  # dense keys unchanged


def test_aux_gradient_of_micro_batches_is_that_of_the_whole_batch() -> None:
    """``aux`` balance with gradient accumulation: the trainer scales the balance loss's
    gradient as the LM loss's, so two micro-batches of 4 give one batch of 8's gradient."""
    aux = {**MOE_KEYS, "model.moe_balance": "aux", "model.moe_aux_coef": 1.0}
    grads = []
    for accum in (1, 2):
        cfg = layout_config("cola", "auto", 1, 1, 1, **aux, **{"train.grad_accum": accum})
        model = ParallelModel.build(cfg, torch.device("cpu"))
        layers = [m for part in model.stages for m in moe_layers(part.model)]
        assert [m.aux_scale for m in layers] == [1 / accum] * 2  # set by the engine's build
        inputs, targets = global_batch(cfg)  # batch_size 4
        inputs, targets = torch.cat([inputs, inputs.flip(0)]), torch.cat([targets, targets.flip(0)])
        for part in torch.arange(8).chunk(accum):
            model.forward_backward(inputs[part], targets[part])
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("cola", {}),
        ("lax", {"moe_shared": 2, "moe_dense_layers": 1, "lax_gate": "full"}),
        ("svd", {"moe_dispatch": "hidden", "moe_balance": "aux"}),
        ("full", {"mlp": "swiglu", "moe_capacity": 1.5}),
    ],
)
def test_parameter_counts_follow_the_modules(arch: str, extra: dict) -> None:
    kw = {k.removeprefix("model."): v for k, v in MOE_KEYS.items()}
    cfg = resolve_model(ModelConfig(preset="tiny", arch=arch, vocab_size=64, n_layers=3, **kw))
    for key, value in extra.items():
        setattr(cfg, key, value)
    validate_moe(cfg)
    model = build_model(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    dense = resolve_model(ModelConfig(preset="tiny", arch=arch, vocab_size=64, n_layers=3))
    dense.mlp = cfg.mlp
    assert count_params(cfg).matmul != count_params(dense).matmul  # the experts a token uses


def test_moe_run_resumes_bitwise_and_evaluates(
    moe_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    cfg = moe_run_config(small_dataset, **{"train.grad_accum": 2})
    interrupted = tmp_path / "interrupted"
    trainer.train(cfg, interrupted, console=False)
    shutil.rmtree(interrupted / "checkpoints" / "step_6")
    trainer.train(
        build_config(interrupted / "config.toml"), interrupted, resume=True, console=False
    )
    expected, got = train_rows(moe_run), train_rows(interrupted)
    assert list(got) == [1, 2, 3, 4, 5, 6]
    assert all(got[step] == expected[step] for step in (4, 5, 6))  # bitwise
    a = load_model_state(open_checkpoint(moe_run / "checkpoints" / "step_6"))
    b = load_model_state(open_checkpoint(interrupted / "checkpoints" / "step_6"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a[BIAS].abs().sum() > 0  # the balance bias moved, was saved, and came back
    step3 = load_model_state(open_checkpoint(moe_run / "checkpoints" / "step_3"))
    assert not torch.equal(step3[BIAS], a[BIAS])

    info = inspect_checkpoint(moe_run)
    assert info["parameters"] == count_params(build_config(moe_run / "config.toml").model).total
    val = [r["val_loss"] for r in read_rows(moe_run) if "val_loss" in r][-1]
    same = 2 * 8 * 32  # the run's validation windows: val_batches x global batch x seq_len
    assert run_eval(moe_run, "val", max_tokens=same, progress=False).loss == pytest.approx(
        val, rel=1e-6
    )
    model, tokenizer = load_pretrained(moe_run)
    assert isinstance(model.layers["1"].mlp, MoEMLP) and torch.equal(
        model.layers["1"].mlp.router.expert_bias, a[BIAS]
    )
    text = generate(model, tokenizer, "def ", max_new_tokens=4, temperature=0.0)
    assert text.startswith("def ") and len(text) > 4
    exported, _ = load_pretrained(export_checkpoint(moe_run, tmp_path / "export"))
    assert torch.equal(dict(exported.named_buffers())[BIAS], a[BIAS])


@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_dp2_trains_the_dp1_global_batch_and_resumes_bitwise(
    moe_run: Path, small_dataset: Path, tmp_path: Path, dp_mode: str
) -> None:
    two = tmp_path / "dp2"
    dp2 = {"parallel.dp": 2, "parallel.dp_mode": dp_mode, "train.batch_size": 2}
    trainer.train(
        moe_run_config(small_dataset, **dp2, **{"train.global_batch": 8}), two, console=False
    )
    single, data_parallel = train_rows(moe_run), train_rows(two)
    assert abs(single[1] - data_parallel[1]) <= 1e-5 * single[1]  # same weights, same batch
    for step in single:
        assert abs(single[step] - data_parallel[step]) <= 1e-3 * single[step], step
    biases = load_model_state(open_checkpoint(two / "checkpoints" / "step_6"))[BIAS]
    assert biases.abs().sum() > 0
    shutil.rmtree(two / "checkpoints" / "step_6")
    trainer.train(build_config(two / "config.toml"), two, resume=True, console=False)
    assert train_rows(two) == data_parallel
    again = load_model_state(open_checkpoint(two / "checkpoints" / "step_6"))[BIAS]
    assert torch.equal(again, biases)


def test_dp2_gradients_match_one_device() -> None:
    """Real gloo ranks, fsdp and ddp: loss, gradient norm and every gradient of each step
    against the single-device model at the same weights, within the fp32 noise bound."""
    moe = dict(MOE_KEYS)
    cases = [
        ("dp2 cola fsdp", layout_config("cola", "auto", 1, 2, 1, **moe), 2),
        (
            "dp2 cola ddp",
            layout_config("cola", "auto", 1, 2, 1, **moe, **{"parallel.dp_mode": "ddp"}),
            1,
        ),
        (
            "dp2 lax block-ckpt",
            layout_config("lax", "auto", 1, 2, 1, **moe, **{"parallel.act_ckpt": "block"}),
            1,
        ),
        (
            "dp2 full hidden aux",
            layout_config("full", "auto", 1, 2, 1, **moe, **{"model.moe_balance": "aux"}),
            1,
        ),
    ]
    for reports in run_distributed(run_cases, 2, cases, timeout_s=900):
        for label, report in reports.items():
            assert_follows(label, report)
