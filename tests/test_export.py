"""HF export, loading back, and text generation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from export_cases import VOCAB, WORDS, write_tokenizer
from export_cases import perturbed_model as _model
from export_cases import random_tokens as _tokens
from export_cases import run_config as _run_config
from export_cases import write_checkpoint as _checkpoint
from safetensors.torch import load_file, save_file

from boostlr.config import RunConfig, model_config_from_dict, to_dict
from boostlr.data.tokenizer import eos_id
from boostlr.errors import BoostlrError
from boostlr.export import (
    export_checkpoint,
    from_hf_state_dict,
    hf_config,
    hf_state_dict,
    load_pretrained,
)
from boostlr.fsutil import sha256_file
from boostlr.generate import generate
from boostlr.models.llama import build_model
from boostlr.rundir.checkpoint import (
    FORMAT_VERSION,
    load_model_state,
    open_checkpoint,
    read_checkpoint,
)
from boostlr.rundir.layout import META_FILE, MODEL_FILE

# DCP warns whenever it saves or loads in one process, which is what these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [("model.n_heads", "4"), ("model.n_kv_heads", "2")],
        [("model.n_heads", "4"), ("model.n_kv_heads", "2"), ("model.tie_embeddings", "true")],
    ],
    ids=["mha", "gqa", "gqa-tied"],
)
def test_full_export_matches_transformers(
    tmp_path: Path, tokenizer_file: Path, overrides: list[tuple[str, str]]
) -> None:
    transformers = pytest.importorskip("transformers")
    # A non-default theta catches a config.json field that transformers silently ignores.
    cfg = _run_config("full", ("model.rope_theta", "500000"), *overrides)
    model = _model(cfg)
    ckpt = _checkpoint(tmp_path / "run", cfg, model, tokenizer_file)
    out = export_checkpoint(ckpt, tmp_path / "export")

    hf, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    hf.eval()
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("cola", []),
        ("svd", [("model.n_kv_heads", "2")]),
        ("lax", []),
        ("lax", [("model.lax_gate", "full"), ("model.tie_embeddings", "true")]),
    ],
    ids=["cola", "svd-gqa", "lax-factored", "lax-full-tied"],
)
def test_lowrank_export_names_shapes_and_round_trip(
    tmp_path: Path, tokenizer_file: Path, arch: str, overrides: list[tuple[str, str]]
) -> None:
    cfg = _run_config(arch, *overrides)
    m = cfg.model
    model = _model(cfg)
    ckpt = _checkpoint(tmp_path / "run", cfg, model, tokenizer_file)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")  # a run dir works too

    tensors = load_file(out / "model.safetensors")
    r, d, kv, f = m.rank, m.dim, m.kv_dim, m.ffn_dim
    expected = {
        "model.embed_tokens.weight": (VOCAB, d),
        "model.norm.weight": (d,),
        "model.layers.0.input_layernorm.weight": (d,),
        "model.layers.0.post_attention_layernorm.weight": (d,),
        "model.layers.0.self_attn.q_proj.down.weight": (r, d),
        "model.layers.0.self_attn.q_proj.up.weight": (d, r),
        "model.layers.1.self_attn.k_proj.up.weight": (kv, r),
        "model.layers.1.mlp.down_proj.down.weight": (r, f),
        "model.layers.1.mlp.gate_proj.up.weight": (f, r),
    }
    if arch == "lax":
        g = m.lax_gate_rank
        expected["model.layers.0.self_attn.q_proj.cross.norm.weight"] = (r,)
        if m.lax_gate == "factored":
            expected["model.layers.1.mlp.up_proj.cross.gate_down.weight"] = (g, r)
            expected["model.layers.1.mlp.up_proj.cross.gate_up.weight"] = (r, g)
        else:
            expected["model.layers.1.mlp.up_proj.cross.gate.weight"] = (r, r)
        assert not any(k.startswith("model.layers.0.") and ".cross.gate" in k for k in tensors)
    else:
        assert not any(".cross." in k for k in tensors)
    for name, shape in expected.items():
        assert tuple(tensors[name].shape) == shape, name
    assert ("lm_head.weight" in tensors) == (not m.tie_embeddings)
    assert not any(k.endswith("_proj.weight") for k in tensors)  # no dense linears

    config = json.loads((out / "config.json").read_text())
    assert model_config_from_dict(config["boostlr"]) == m
    assert config["eos_token_id"] == 0

    tokens = _tokens()
    with torch.no_grad():
        expected_logits = model(tokens)
        for source in (out, ckpt, tmp_path / "run"):
            loaded, tokenizer = load_pretrained(source)
            assert not loaded.training
            assert torch.equal(loaded(tokens), expected_logits)
            if m.tie_embeddings:
                assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert tokenizer.get_vocab_size() <= VOCAB


def test_state_dict_renaming_is_invertible() -> None:
    state = {
        "embed_tokens.weight": torch.zeros(1),
        "layers.0.self_attn.q_proj.down.weight": torch.zeros(1),
        "norm.weight": torch.zeros(1),
        "lm_head.weight": torch.zeros(1),
    }
    hf = hf_state_dict(state)
    assert sorted(hf) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.down.weight",
        "model.norm.weight",
    ]
    assert from_hf_state_dict(hf) == state
    with pytest.raises(BoostlrError):
        from_hf_state_dict({"transformer.wte.weight": torch.zeros(1)})


def test_hf_config_fields() -> None:
    m = _run_config("full", ("model.n_heads", "4"), ("model.n_kv_heads", "2")).model
    config = hf_config(m)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (
        m.dim,
        2,
        m.dim // 4,
    )
    assert config["boostlr"]["arch"] == "full"
    json.dumps(config)


def test_export_refuses_foreign_dir_and_replaces_earlier_export(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    cfg = _run_config("cola")
    ckpt = _checkpoint(tmp_path / "run", cfg, _model(cfg), tokenizer_file)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(BoostlrError, match="--out"):
        export_checkpoint(ckpt, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"

    out = tmp_path / "nested" / "export"
    export_checkpoint(ckpt, out)
    cfg2 = _run_config("cola")
    ckpt2 = _checkpoint(tmp_path / "run2", cfg2, _model(cfg2, seed=7), tokenizer_file)
    export_checkpoint(ckpt2, out)  # over an earlier export: allowed
    assert torch.equal(
        load_file(out / "model.safetensors")["model.embed_tokens.weight"],
        load_model_state(read_checkpoint(ckpt2))["embed_tokens.weight"],
    )
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]  # no temp dirs left


def _in_memory_export(ckpt_dir: Path, path: Path) -> None:
    """``model.safetensors`` as export wrote it before it streamed: all tensors, save_file."""
    ckpt = open_checkpoint(ckpt_dir)
    state = load_model_state(ckpt)
    if ckpt.meta["config"]["model"].get("tie_embeddings"):
        state.pop("lm_head.weight", None)
    tensors = {k: v.contiguous() for k, v in hf_state_dict(state).items()}
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "arch,overrides",
    [("cola", []), ("lax", [("model.lax_gate", "full"), ("model.tie_embeddings", "true")])],
    ids=["cola", "lax-tied"],
)
def test_streamed_export_equals_the_in_memory_export(
    tmp_path: Path, tokenizer_file: Path, arch: str, overrides: list[tuple[str, str]]
) -> None:
    cfg = _run_config(arch, *overrides)
    ckpt = _checkpoint(tmp_path / "run", cfg, _model(cfg), tokenizer_file)
    out = export_checkpoint(ckpt, tmp_path / "export")
    _in_memory_export(ckpt, tmp_path / "reference.safetensors")
    assert (out / MODEL_FILE).read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "configuration_boostlr.py",
        "model.safetensors",
        "modeling_boostlr.py",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.slow
def test_sharded_checkpoint_exports_like_the_in_memory_export(
    sharded_run: Path, tmp_path: Path
) -> None:
    """A TP-2 checkpoint of the real trainer, consolidated tensor by tensor."""
    ckpt = open_checkpoint(sharded_run)
    assert ckpt.meta["sharded"] is True and (ckpt.path / ".metadata").is_file()
    out = export_checkpoint(sharded_run, tmp_path / "export")
    _in_memory_export(ckpt.path, tmp_path / "reference.safetensors")
    assert (out / MODEL_FILE).read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    model, _ = load_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == sum(
        t.numel() for t in load_model_state(ckpt).values()
    )


# --- export memory ---------------------------------------------------------------------------
# A dense model of many equal-size tensors: 6 layers x (4 x 1 MiB attention + 3 x 2 MiB MLP)
# plus 1 MiB embedding and head, about 62 MiB in all, the largest tensor 2 MiB. An export
# that held the model would grow by at least the total; a streaming one by a few tensors.
MEMORY_MODEL = [
    ("model.dim", "512"),
    ("model.n_layers", "6"),
    ("model.n_heads", "8"),
    ("model.n_kv_heads", "8"),
    ("model.ffn_dim", "1024"),
]


def _write_checkpoint(
    root: Path, cfg: RunConfig, state: dict[str, torch.Tensor], tokenizer: Path
) -> Path:
    """A checkpoint by the documented contract (a DCP directory of ``model.<name>`` entries,
    then meta.json with sizes and sha256).

    Written here rather than by the trainer so the sizes are exactly controlled.
    """
    path = root / "checkpoints" / "step_1"
    path.mkdir(parents=True)
    dcp.save({f"model.{k}": v for k, v in state.items()}, checkpoint_id=path, no_dist=True)
    (path / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    files = {
        f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(path.iterdir())
    }
    meta = {"format": FORMAT_VERSION, "step": 1, "files": files, "sharded": True}
    meta |= {"config": {"model": to_dict(cfg)["model"]}, "layout": {"pp": 1, "dp": 1, "tp": 1}}
    (path / META_FILE).write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def memory_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path
) -> dict[str, Path | int]:
    root = tmp_path_factory.mktemp("memory")
    big = _run_config("full", *MEMORY_MODEL)
    state = build_model(big.model, seed=0).state_dict()
    sizes = [t.numel() * t.element_size() for t in state.values()]
    tiny = _run_config("full")
    tiny_state = build_model(tiny.model, seed=0).state_dict()
    out: dict[str, Path | int] = {"total": sum(sizes), "largest": max(sizes)}
    out["sharded"] = _write_checkpoint(root / "sharded", big, state, tokenizer_file)
    out["sharded_warmup"] = _write_checkpoint(
        root / "sharded_warmup", tiny, tiny_state, tokenizer_file
    )
    return out


def _peak_growth(mode: str, warmup: Path, checkpoint: Path, out: Path) -> int:
    script = Path(__file__).with_name("peak_rss.py")
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(warmup), str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="measures memory through /proc")
def test_export_peak_memory_is_a_few_tensors_not_the_model(
    memory_checkpoints: dict, tmp_path: Path
) -> None:
    total, largest = memory_checkpoints["total"], memory_checkpoints["largest"]
    assert total >= 30 * largest  # the model is far larger than any one tensor
    growth = _peak_growth(
        "streamed", memory_checkpoints["sharded_warmup"], memory_checkpoints["sharded"], tmp_path
    )
    # The tensor being read and the reader's staging copies are a few times the largest
    # tensor; holding the model would be at least the total, 31 times the largest.
    mib = f"peak grew {growth / 2**20:.1f} MiB for a {total / 2**20:.0f} MiB model"
    assert growth < total / 4, mib
    exported = load_file(tmp_path / "export" / MODEL_FILE)
    assert sum(t.numel() * t.element_size() for t in exported.values()) == total


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="measures memory through /proc")
def test_peak_memory_measure_sees_torch_allocations(
    memory_checkpoints: dict, tmp_path: Path
) -> None:
    """The same measure over the old gathering export shows the whole model: it is real."""
    growth = _peak_growth(
        "gathered",
        memory_checkpoints["sharded_warmup"],
        memory_checkpoints["sharded"],
        tmp_path,
    )
    total = memory_checkpoints["total"]
    assert growth >= 0.9 * total, f"grew {growth / 2**20:.1f} MiB of {total / 2**20:.0f} MiB"


def test_load_pretrained_rejects_other_dirs(tmp_path: Path) -> None:
    with pytest.raises(BoostlrError, match="neither a checkpoint nor an export"):
        load_pretrained(tmp_path)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path):
    cfg = _run_config("cola")
    root = tmp_path_factory.mktemp("gen")
    _checkpoint(root / "run", cfg, _model(cfg), tokenizer_file)
    return load_pretrained(root / "run")


def test_greedy_generation_matches_manual_argmax(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    prompt = "alpha beta gamma"
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        for _ in range(6):
            next_id = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(next_id)
            if next_id == eos_id(tokenizer):
                break
    text = generate(model, tokenizer, prompt, max_new_tokens=6, temperature=0)
    assert text == tokenizer.decode(ids)
    assert text.startswith(prompt)
    assert generate(model, tokenizer, prompt, max_new_tokens=6, temperature=0, seed=9) == text


def test_sampling_is_reproducible_per_seed(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    runs = [
        generate(model, tokenizer, "delta", max_new_tokens=12, temperature=1.5, seed=s)
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0].startswith("delta")
    full_vocab = generate(model, tokenizer, "delta", max_new_tokens=4, top_k=None, seed=1)
    assert full_vocab == generate(model, tokenizer, "delta", max_new_tokens=4, top_k=None, seed=1)


def test_generation_truncates_context(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    model.cfg.max_seq_len, saved = 4, model.cfg.max_seq_len
    try:
        text = generate(model, tokenizer, WORDS, max_new_tokens=5, temperature=0)
    finally:
        model.cfg.max_seq_len = saved
    assert text.startswith(WORDS)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"prompt": ""}, "--prompt"),
        ({"temperature": -0.1}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"top_k": 0}, "--top-k"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
    ],
)
def test_generate_rejects_bad_arguments(tiny_lm, kwargs: dict, flag: str) -> None:
    model, tokenizer = tiny_lm
    args = {"prompt": "alpha", **kwargs}
    with pytest.raises(BoostlrError, match=flag):
        generate(model, tokenizer, **args)
