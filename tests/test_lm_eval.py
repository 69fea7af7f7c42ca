"""lm-evaluation-harness on boostlr exports: ``lm_eval --model hf`` agrees with ``boostlr eval``.

A tiny model of each arch is trained for a few steps by the real trainer (so its loss is
well below uniform: an export that loaded as a random model could not agree), exported, and
scored on the same local text twice: by ``lm_eval.simple_evaluate`` (model ``hf``, a task
built from a JSON Lines file, ``loglikelihood_rolling``, bits per byte) and by
``boostlr eval`` on that text prepared with the export's tokenizer. Windows differ (lm-eval
rolls each document from a prefix token; boostlr eval cuts one stream of documents and EOS
tokens), hence the 10% tolerance.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest

from boostlr.config import build_config
from boostlr.data import prepare_dataset
from boostlr.evaluate import run_eval
from boostlr.export import export_checkpoint

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model needs it (the lm-eval[hf] extra)

SEQ_LEN = 64
TASK = "boostlr_text"


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three documents of real text (stdlib prose and code) as JSON Lines."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = (stdlib / "textwrap.py").read_text()
    docs = [source[i : i + 2500] for i in (0, 6000, 12000)]
    path = tmp_path_factory.mktemp("text") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _task_dir(root: Path, text: Path) -> Path:
    """A local lm-eval task: every JSONL record's ``text`` scored as one rolling document."""
    root.mkdir()
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(text))}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n"
        "  - metric: bits_per_byte\n"
        "    aggregation: bits_per_byte\n"
        "    higher_is_better: false\n"
    )
    return root


def _train_and_export(arch: str, data: Path, root: Path) -> Path:
    from boostlr.train import run as trainer

    overrides = {
        "model.preset": "tiny",
        "model.arch": arch,
        "model.n_kv_heads": "2",  # GQA through lm-eval too
        "data.path": str(data),
        "data.seq_len": str(SEQ_LEN),
        "data.val_batches": "1",
        "train.batch_size": "8",
        "train.steps": "100",
        "train.warmup": "5",
        "train.lr": "1e-2",
        "train.eval_every": "100",
        "train.ckpt_every": "100",
        "parallel.device": "cpu",
    }
    trainer.train(build_config(overrides=list(overrides.items())), root / "run", console=False)
    return export_checkpoint(root / "run", root / "export")


@pytest.fixture(scope="module")
def task_manager(eval_text: Path, tmp_path_factory: pytest.TempPathFactory) -> object:
    """The local task alone: indexing lm-eval's thousands of built-in tasks takes seconds."""
    from lm_eval.tasks import TaskManager

    tasks = _task_dir(tmp_path_factory.mktemp("tasks") / "tasks", eval_text)
    return TaskManager(include_path=str(tasks), include_defaults=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["full", "svd", "cola", "lax"])
def test_lm_eval_bits_per_byte_agrees_with_boostlr_eval(
    arch: str,
    small_dataset: Path,
    eval_text: Path,
    task_manager: object,
    tmp_path: Path,
    monkeypatch,
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # lm-eval writes nothing here, but looks for a git repo
    export = _train_and_export(arch, small_dataset, tmp_path)

    data = tmp_path / "eval_data"
    prepare_dataset(
        [eval_text],
        data,
        tokenizer=str(export / "tokenizer.json"),
        val_fraction=0.0,
        progress=False,
    )
    ours = run_eval(
        export,
        "train",
        overrides=[("data.path", str(data)), ("data.seq_len", str(SEQ_LEN))],
        progress=False,
    )
    uniform = math.log2(json.loads((export / "config.json").read_text())["vocab_size"])
    assert ours.bits_per_byte < 0.85 * uniform * ours.tokens / ours.bytes  # it learned

    result = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},trust_remote_code=True,dtype=float32,max_length={SEQ_LEN}",
        tasks=[TASK],
        task_manager=task_manager,
        batch_size=4,
        device="cpu",
    )
    theirs = result["results"][TASK]["bits_per_byte,none"]
    assert theirs == pytest.approx(ours.bits_per_byte, rel=0.10), (theirs, ours.bits_per_byte)
