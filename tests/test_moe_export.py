"""``boostlr export`` of mixture-of-experts models: real transformers remote code, boostlr's logits.

Every MoE form goes through ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``
(the modules copied into the export, not boostlr's): latent dispatch for cola, svd and lax,
hidden dispatch for full and cola, both balances (the ``bias`` buffer exported and moved off
zero so that it changes the routing), shared experts, dense first blocks and a capacity. The
logits must equal boostlr's own forward within the fp32 noise bound (tests/fp32_noise.py:
boostlr's fp32 logits against its float64 ones set the yardstick).
"""

from __future__ import annotations

import copy
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from export_cases import (
    load_remote,
    perturbed_model,
    prepare_words,
    random_tokens,
    run_config,
    write_checkpoint,
)
from export_cases import write_tokenizer as _write_tokenizer
from fp32_noise import difference_bound, relative_error
from test_train import tiny_run_config
from tokenizers import Tokenizer

from boostlr.cli import main
from boostlr.config import RunConfig, build_config
from boostlr.data import prepare_dataset
from boostlr.evaluate import run_eval
from boostlr.export import export_checkpoint, hf_name, load_pretrained
from boostlr.hf import HF_DIR, MOE_REMOTE_CODE_FILES, REMOTE_CODE_FILES
from boostlr.models.llama import LlamaModel
from boostlr.models.moe import moe_layers
from boostlr.rundir.checkpoint import list_checkpoints, load_model_state, open_checkpoint
from boostlr.specs.arch import ARCHS
from boostlr.train import run as trainer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MOE = [("model.moe_experts", "4"), ("model.moe_top_k", "2"), ("model.moe_ffn_dim", "32")]
# Three blocks where the first stays dense, so dense and MoE blocks (and LaX's latents
# crossing from one to the other) are both exported.
DENSE_FIRST = [("model.n_layers", "3"), ("model.moe_dense_layers", "1")]
CASES = {
    "cola-latent-bias-shared-dense1": ("cola", [*DENSE_FIRST, ("model.moe_shared", "1")]),
    "svd-latent-aux-gqa": ("svd", [("model.moe_balance", "aux"), ("model.n_kv_heads", "2")]),
    "lax-latent-bias-shared2-dense1-tied": (
        "lax",
        [*DENSE_FIRST, ("model.moe_shared", "2"), ("model.tie_embeddings", "true")],
    ),
    "full-hidden-bias-shared-dense1": ("full", [*DENSE_FIRST, ("model.moe_shared", "1")]),
    "cola-hidden-aux-swiglu": (
        "cola",
        [("model.moe_dispatch", "hidden"), ("model.moe_balance", "aux"), ("model.mlp", "swiglu")],
    ),
    "svd-hidden-bias": ("svd", [("model.moe_dispatch", "hidden")]),
    "cola-latent-capacity": ("cola", [("model.moe_capacity", "0.75")]),
    "full-hidden-capacity-aux": (
        "full",
        [("model.moe_capacity", "1.0"), ("model.moe_balance", "aux"), ("model.n_kv_heads", "2")],
    ),
}
DROPLESS = [c for c in CASES if "capacity" not in c]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def words_dataset(tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path) -> Path:
    return prepare_words(tmp_path_factory.mktemp("words"), tokenizer_file)


def moe_model(case: str) -> tuple[RunConfig, LlamaModel]:
    """The case's tiny model, every parameter perturbed and the balance bias moved off zero
    as training moves it (so a bias left out of the export would change the routing)."""
    arch, overrides = CASES[case]
    cfg = run_config(arch, *MOE, *overrides)
    model = perturbed_model(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
    return cfg, model


def _export(root: Path, case: str, tokenizer_file: Path) -> tuple[RunConfig, LlamaModel, Path]:
    cfg, model = moe_model(case)
    ckpt = write_checkpoint(root / "run", cfg, model, tokenizer_file)
    return cfg, model, export_checkpoint(ckpt, root / "export")


def assert_logits_within_noise(
    theirs: torch.Tensor, model: LlamaModel, tokens: torch.Tensor, last: bool = False
) -> None:
    """``theirs`` against boostlr's fp32 logits (``last``: at the last position only),
    within the noise of those against float64."""
    with torch.no_grad():
        ours = model(tokens)
        exact = copy.deepcopy(model).double()(tokens)
    if last:
        ours, exact = ours[:, -1:], exact[:, -1:]
    noise = relative_error(ours, exact)
    assert noise < 1e-4, noise  # float64 routed as fp32 did: the yardstick is rounding only
    assert theirs.dtype == torch.float32
    assert relative_error(theirs, ours) <= difference_bound(noise), (
        relative_error(theirs, ours),
        noise,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_moe_export_is_a_remote_code_model_with_our_logits(
    tmp_path: Path, tokenizer_file: Path, case: str
) -> None:
    cfg, model, out = _export(tmp_path, case, tokenizer_file)
    m = cfg.model
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"boostlr_{m.arch}"
    assert config["architectures"] == [f"Boostlr{m.arch.capitalize()}MoeForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_boostlr_moe.")
    assert config["moe_experts"] == 4 and config["moe_dense_layers"] == m.moe_dense_layers
    assert config["moe_dispatch"] == (
        "hidden" if m.arch == "full" or "hidden" in case else "latent"
    )
    assert config["boostlr"]["moe_experts"] == 4  # boostlr's own section, as for dense
    for name in MOE_REMOTE_CODE_FILES:
        assert (out / name).read_bytes() == (HF_DIR / name).read_bytes()

    hf = load_remote(out)
    assert type(hf).__module__.startswith("transformers_modules")
    assert type(hf).__name__ == config["architectures"][0]
    # The remote code's names are boostlr's, the balance bias included.
    ours = {hf_name(k) for k in model.state_dict() if not k.endswith(".load")}
    if m.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert set(hf.state_dict()) == ours
    biases = [k for k in ours if k.endswith("expert_bias")]
    assert len(biases) == (len(moe_layers(model)) if m.moe_balance == "bias" else 0)
    for key in biases:
        assert torch.equal(hf.state_dict()[key], model.state_dict()[key.removeprefix("model.")])

    tokens = random_tokens()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert_logits_within_noise(theirs, model, tokens)
    if m.moe_capacity:  # the case really drops copies, and the export drops the same ones
        assert sum(int(layer.dropped) for layer in moe_layers(model)) > 0


@pytest.mark.parametrize("arch", ["cola", "full"])
def test_a_dense_export_has_no_moe_fields_or_file(
    tmp_path: Path, tokenizer_file: Path, arch: str
) -> None:
    """The MoE fields and module join MoE exports only: a dense export is what it was."""
    cfg = run_config(arch)
    ckpt = write_checkpoint(tmp_path / "run", cfg, perturbed_model(cfg), tokenizer_file)
    out = export_checkpoint(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert not [k for k in [*config, *config["boostlr"]] if k.startswith("moe_")]
    assert not (out / MOE_REMOTE_CODE_FILES[-1]).exists()
    assert all((out / f).exists() == cfg.model.lowrank for f in REMOTE_CODE_FILES)


def test_the_exported_bias_decides_the_routing(tmp_path: Path, tokenizer_file: Path) -> None:
    """Zeroing the balance bias moves the logits far past the noise: the equality above
    would fail if the export lost it."""
    case = "cola-latent-bias-shared-dense1"
    _, model, out = _export(tmp_path, case, tokenizer_file)
    hf = load_remote(out)
    tokens = random_tokens()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("expert_bias"):
                buf.zero_()
        unbiased = hf(input_ids=tokens).logits
        ours = model(tokens)
    assert relative_error(unbiased, ours) > 1e-2


@pytest.mark.parametrize("case", DROPLESS)
def test_moe_generate_with_kv_cache_matches_boostlr_greedy(
    tmp_path: Path, tokenizer_file: Path, case: str
) -> None:
    _, model, out = _export(tmp_path, case, tokenizer_file)
    hf = load_remote(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("alpha beta gamma delta").ids])
    new = 10
    with torch.no_grad():
        cached = hf.generate(
            ids, max_new_tokens=new, do_sample=False, use_cache=True, eos_token_id=None
        )
        step = hf(input_ids=cached[:, :-1], use_cache=True)
        cache = getattr(step, "cache", None) or getattr(step, "past_key_values", None)
        assert cache is not None and cache.get_seq_length() == cached.shape[1] - 1
        last = hf(input_ids=cached[:, -1:], **{_cache_arg(): cache}).logits
        ours = ids
        for _ in range(new):  # boostlr's model, recomputing the whole context each step
            ours = torch.cat([ours, model(ours)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert_logits_within_noise(last, model, cached, last=True)  # the cache is used, and right
    assert cached.tolist() == ours.tolist()


def test_moe_left_padded_batch_generates_what_each_prompt_does_alone(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    """Dropless routing is per token, so padding a prompt beside a longer one changes
    nothing (lm-eval and batched generation pad)."""
    _, _, out = _export(tmp_path, "lax-latent-bias-shared2-dense1-tied", tokenizer_file)
    hf = load_remote(out)
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    tok.padding_side = "left"
    prompts = ["alpha beta gamma delta epsilon zeta", "kappa lambda"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert not bool(batch["attention_mask"].all())
    kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None}
    with torch.no_grad():
        together = hf.generate(**batch, **kwargs)
        for row, prompt in enumerate(prompts):
            alone = hf.generate(**tok(prompt, return_tensors="pt"), **kwargs)
            assert together[row, -6:].tolist() == alone[0, -6:].tolist()


def test_every_arch_has_its_moe_model_class() -> None:
    """``config.json`` names a class the MoE module has, for every arch, with the config
    class of that arch (transformers checks the two agree)."""
    from boostlr.hf.configuration_boostlr import CONFIG_CLASSES, MOE_CONFIG_CLASSES
    from boostlr.hf.files import config_class, model_class
    from boostlr.hf.modeling_boostlr_moe import MOE_MODEL_CLASSES

    assert set(MOE_MODEL_CLASSES) == set(MOE_CONFIG_CLASSES) == set(ARCHS)
    for arch, cls in MOE_MODEL_CLASSES.items():
        configs = MOE_CONFIG_CLASSES[arch]
        assert cls.config_class is configs and configs.arch == arch
        assert configs is not CONFIG_CLASSES.get(arch)  # never the dense model's config class
        m = run_config(arch, *MOE).model
        assert model_class(m) == (MOE_REMOTE_CODE_FILES[-1].removesuffix(".py"), cls.__name__)
        assert config_class(m) == configs.__name__


def test_a_dense_then_an_moe_export_from_same_named_directories(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    """transformers names a local export's remote code by its directory's name and maps
    config classes to model classes process-wide: a dense cola export loaded first must not
    lend an MoE cola export (in a directory of the same name) its dense model class."""
    cfg = run_config("cola")
    dense = perturbed_model(cfg)
    ckpt = write_checkpoint(tmp_path / "dense" / "run", cfg, dense, tokenizer_file)
    load_remote(export_checkpoint(ckpt, tmp_path / "dense" / "export"))
    _, model, out = _export(tmp_path / "moe", "cola-latent-bias-shared-dense1", tokenizer_file)
    hf = load_remote(out)  # every MoE weight loaded: none missing
    tokens = random_tokens().remainder(model.cfg.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert_logits_within_noise(theirs, model, tokens)


def test_capacity_export_generates(tmp_path: Path, tokenizer_file: Path) -> None:
    """With a capacity, a cached step routes its one token alone (nothing to drop), so
    greedy text may differ from boostlr's recomputing generate (docs/moe.md); it runs, and
    the prompt's forward is boostlr's."""
    _, model, out = _export(tmp_path, "cola-latent-capacity", tokenizer_file)
    hf = load_remote(out)
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    batch = tok(["alpha beta gamma delta epsilon", "kappa"], return_tensors="pt", padding=True)
    with torch.no_grad():
        text = hf.generate(**batch, max_new_tokens=5, do_sample=False, eos_token_id=None)
        prompt = tok("alpha beta gamma delta epsilon", return_tensors="pt")["input_ids"]
        theirs = hf(input_ids=prompt).logits
    assert text.shape == (2, batch["input_ids"].shape[1] + 5)
    assert_logits_within_noise(theirs, model, prompt)


def _cache_arg() -> str:
    fields = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    return "cache" if "cache" in fields else "past_key_values"


def test_merge_svd_of_an_moe_model_is_one_line(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = run_config("svd", *MOE, ("model.mlp", "swiglu"))
    ckpt = write_checkpoint(tmp_path / "run", cfg, perturbed_model(cfg), tokenizer_file)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--merge-svd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--merge-svd: an MoE model" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case", ["lax-latent-bias-shared2-dense1-tied", "full-hidden-capacity-aux"]
)
def test_moe_export_imports_back_exactly_and_resumes(
    tmp_path: Path,
    tokenizer_file: Path,
    words_dataset: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    """``boostlr import-hf`` takes boostlr's own MoE export back: router, experts and the
    balance bias (a buffer the step-0 checkpoint keeps, as the trainer's do)."""
    cfg, model, export = _export(tmp_path, case, tokenizer_file)
    run = tmp_path / "imported"
    data = ["--data.path", str(words_dataset), "--data.seq_len", "16", "--train.batch_size", "2"]
    assert main(["import-hf", str(export), "--out", str(run), *data]) == 0
    state = load_model_state(open_checkpoint(run))
    for name, tensor in model.state_dict().items():
        if name.endswith(".load") or (cfg.model.tie_embeddings and name == "lm_head.weight"):
            continue
        assert torch.equal(state[name], tensor), name
    imported, _ = load_pretrained(run)
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(imported(tokens), model(tokens))

    code = main(["train", "--run-dir", str(run), "--resume", "--quiet", "--train.steps", "2"])
    assert code == 0, capsys.readouterr().err
    assert [c.step for c in list_checkpoints(run / "checkpoints")] == [0, 2]


@pytest.mark.parametrize("ep", [1, 2])
def test_export_of_a_dp2_run_has_the_runs_logits(
    ep: int, small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint the real trainer wrote at dp 2 (FSDP shards; at ep 2 the routed experts
    as two expert shards), with shared experts and a dense first block: the export
    consolidates it, the balance bias included."""
    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_dim": 64}
    extra = {"model.n_layers": 3, "model.moe_dense_layers": 1, "model.moe_shared": 1}
    dp2 = {"parallel.dp": 2, "train.batch_size": 2, "train.global_batch": 8}
    if ep > 1:
        dp2["parallel.ep"] = ep
    run = tmp_path / "dp2"
    trainer.train(tiny_run_config(small_dataset, **moe, **extra, **dp2), run, console=False)
    layout = open_checkpoint(run).meta["layout"]
    assert layout["dp"] == 2 and layout.get("ep", 1) == ep
    model, _ = load_pretrained(run)
    bias = dict(model.named_buffers())["layers.2.mlp.router.expert_bias"]
    assert bias.abs().sum() > 0  # trained: the bias moved
    out = export_checkpoint(run, tmp_path / "export")
    hf = load_remote(out)
    assert torch.equal(hf.model.layers[2].mlp.router.expert_bias, bias)
    tokens = random_tokens().remainder(model.cfg.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert_logits_within_noise(theirs, model, tokens)


@pytest.mark.slow
def test_lm_eval_runs_on_an_moe_export(
    small_dataset: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch
) -> None:
    """lm-evaluation-harness scores a trained CoLA MoE export (latent dispatch, a shared
    expert, a dense first block) as it scores the dense archs in tests/test_lm_eval.py:
    its bits per byte agree with ``boostlr eval`` on the same text within 10%."""
    lm = pytest.importorskip("test_lm_eval")  # skips without lm-eval[hf]
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.jsonl"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = (stdlib / "textwrap.py").read_text()
    text.write_text("".join(json.dumps({"text": source[i : i + 2500]}) + "\n" for i in (0, 6000)))
    tasks = TaskManager(
        include_path=str(lm._task_dir(tmp_path / "tasks", text)), include_defaults=False
    )

    overrides = {
        "model.preset": "tiny",
        "model.arch": "cola",
        "model.n_layers": "3",
        "model.moe_experts": "4",
        "model.moe_top_k": "2",
        "model.moe_ffn_dim": "64",
        "model.moe_shared": "1",
        "model.moe_dense_layers": "1",
        "data.path": str(small_dataset),
        "data.seq_len": str(lm.SEQ_LEN),
        "data.val_batches": "1",
        "train.batch_size": "8",
        "train.steps": "100",
        "train.warmup": "5",
        "train.lr": "1e-2",
        "train.eval_every": "100",
        "train.ckpt_every": "100",
        "parallel.device": "cpu",
    }
    trainer.train(build_config(overrides=list(overrides.items())), tmp_path / "run", console=False)
    export = export_checkpoint(tmp_path / "run", tmp_path / "export")

    data = tmp_path / "eval_data"
    tokenizer = str(export / "tokenizer.json")
    prepare_dataset([text], data, tokenizer=tokenizer, val_fraction=0.0, progress=False)
    seq = [("data.path", str(data)), ("data.seq_len", str(lm.SEQ_LEN))]
    ours = run_eval(export, "train", overrides=seq, progress=False)
    uniform = math.log2(json.loads((export / "config.json").read_text())["vocab_size"])
    assert ours.bits_per_byte < 0.85 * uniform * ours.tokens / ours.bytes  # it learned

    result = simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},trust_remote_code=True,dtype=float32,"
        f"max_length={lm.SEQ_LEN}",
        tasks=[lm.TASK],
        task_manager=tasks,
        batch_size=4,
        device="cpu",
    )
    theirs = result["results"][lm.TASK]["bits_per_byte,none"]
    assert theirs == pytest.approx(ours.bits_per_byte, rel=0.10), (theirs, ours.bits_per_byte)
