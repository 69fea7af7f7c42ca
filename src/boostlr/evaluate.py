"""``boostlr eval``: loss, perplexity and bits per byte of a model on a whole split.

The evaluated tokens are the split's token stream read in order: every token but the first is
a target exactly once (windows of ``seq_len`` at stride ``seq_len``, the last one shorter), so
nothing is dropped and nothing is counted twice. ``max_tokens`` stops after that many targets.

Bits per byte is ``total nats / ln 2 / bytes``, where ``bytes`` counts the UTF-8 bytes of the
evaluated *target* text: the target token ids are cut at every end-of-document token, each
piece is decoded with the tokenizer (special tokens skipped) and the UTF-8 length of the
decoded string is summed. End-of-document tokens thus add their nats but no bytes (they are
not text), and a document's bytes are exactly its text's for a lossless tokenizer such as
the byte-level BPE of ``boostlr prepare``. Only the two ends of the evaluated range can cut a
multi-byte character; it then decodes as U+FFFD (3 bytes). Because the denominator does not
depend on the vocabulary, runs with different tokenizers compare.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tokenizers import Tokenizer

from boostlr.config import DEVICES, DTYPES, RunConfig, apply_mapping, from_dict
from boostlr.data import TokenDataset, default_dataset, eos_id, load_tokenizer
from boostlr.data.prepare import default_dataset_ready
from boostlr.errors import BoostlrError, DataError
from boostlr.export import export_model_config, is_export, load_pretrained
from boostlr.models.llama import LlamaModel
from boostlr.rundir.checkpoint import open_checkpoint
from boostlr.rundir.layout import TOKENIZER_FILE

# Keys ``boostlr eval`` accepts as ``--section.key VALUE``: what to read and how, never the model.
EVAL_KEYS = (
    "data.path",
    "data.seq_len",
    "data.default_vocab",
    "train.batch_size",
    "train.dtype",
    "parallel.device",
)


@dataclass(frozen=True)
class EvalResult:
    nats: float  # summed cross-entropy of all targets
    tokens: int  # targets evaluated
    bytes: int  # UTF-8 bytes of the decoded targets (see the module docstring)

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes if self.bytes else float("nan")

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` record; keys are only ever added, never renamed."""
        return {
            "loss": self.loss,
            "ppl": self.ppl,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            "bytes": self.bytes,
        }


def windows(n_tokens: int, seq_len: int, max_targets: int | None = None) -> list[tuple[int, int]]:
    """``(start, length)`` of each window: inputs ``[start, start+length)``, targets shifted by 1.

    The windows cover targets ``1 .. n`` of the stream exactly once, in order.
    """
    targets = max(0, n_tokens - 1)
    if max_targets is not None:
        targets = min(targets, max_targets)
    return [(start, min(seq_len, targets - start)) for start in range(0, targets, seq_len)]


class ByteCounter:
    """UTF-8 bytes of a stream of target ids, decoded one document piece at a time."""

    def __init__(self, tokenizer: Tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.total = 0
        self._pending: list[int] = []

    def feed(self, ids: np.ndarray) -> None:
        cuts = np.flatnonzero(ids == self.eos)
        start = 0
        for cut in cuts:
            self._flush(ids[start:cut].tolist())
            start = int(cut) + 1
        self._pending.extend(ids[start:].tolist())

    def _flush(self, tail: list[int]) -> None:
        piece, self._pending = self._pending + tail, []
        if piece:
            text = self.tokenizer.decode(piece, skip_special_tokens=True)
            self.total += len(text.encode("utf-8"))

    def finish(self) -> int:
        self._flush([])
        return self.total


@torch.no_grad()
def evaluate_dataset(
    model: LlamaModel,
    dataset: TokenDataset,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    autocast: AbstractContextManager | None = None,
    progress: bool = False,
) -> EvalResult:
    """Summed loss over the split's targets (in order), and their byte count."""
    if seq_len < 1 or batch_size < 1:
        raise BoostlrError(f"seq_len ({seq_len}) and batch size ({batch_size}) must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise BoostlrError(f"--max-tokens must be >= 1, got {max_tokens}")
    spans = windows(len(dataset), seq_len, max_tokens)
    if not spans:
        raise DataError(
            f"the {dataset.split} split of {dataset.path} has {len(dataset)} tokens: nothing to "
            "evaluate; pick another --split or dataset"
        )
    model.eval()
    device = next(model.parameters()).device
    counter = ByteCounter(tokenizer, eos_id(tokenizer))
    nats, count = 0.0, 0
    with _progress(progress, sum(n for _, n in spans)) as advance:
        for batch in _batches(spans, batch_size):
            rows = np.stack([dataset.tokens(start, n + 1) for start, n in batch])
            inputs = torch.from_numpy(rows[:, :-1]).to(device)
            targets = torch.from_numpy(rows[:, 1:]).to(device)
            with autocast or nullcontext():
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            nats += float(loss)
            count += targets.numel()
            for row in rows:
                counter.feed(row[1:])
            advance(targets.numel())
    return EvalResult(nats=nats, tokens=count, bytes=counter.finish())


def _batches(spans: list[tuple[int, int]], batch_size: int) -> Iterator[list[tuple[int, int]]]:
    """Consecutive spans of equal length, at most ``batch_size`` at a time (order kept)."""
    batch: list[tuple[int, int]] = []
    for span in spans:
        if batch and (len(batch) == batch_size or span[1] != batch[0][1]):
            yield batch
            batch = []
        batch.append(span)
    if batch:
        yield batch


class _progress:
    """A rich bar on stderr when it is a terminal (stdout stays clean for ``--json``)."""

    def __init__(self, enabled: bool, total: int):
        console = Console(stderr=True)
        self._bar = Progress(
            TextColumn("[bold]eval"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not (enabled and console.is_terminal),
        )
        self._task = self._bar.add_task("eval", total=total)

    def __enter__(self):
        self._bar.start()
        return lambda n: self._bar.advance(self._task, n)

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()


# ---------------------------------------------------------------------------- the command


def source_config(path: Path) -> RunConfig:
    """The run config behind a checkpoint, run or export dir (an export has the model only)."""
    path = Path(path)
    if not path.exists():
        raise BoostlrError(
            f"{path} does not exist: pass runs/<run>, runs/<run>/checkpoints/step_N, or a "
            "directory written by boostlr export"
        )
    if is_export(path):
        cfg = RunConfig()
        cfg.model = export_model_config(path)
        if 260 <= cfg.model.vocab_size < 2**32:
            cfg.data.default_vocab = cfg.model.vocab_size
        return cfg
    ckpt = open_checkpoint(path)
    saved = ckpt.meta.get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise BoostlrError(f"checkpoint {ckpt.path} holds no config: evaluate a boostlr run")
    return from_dict(saved)


def apply_eval_overrides(cfg: RunConfig, pairs: list[tuple[str, str]]) -> None:
    for key, value in pairs:
        if key not in EVAL_KEYS:
            raise BoostlrError(
                f"boostlr eval does not take --{key}: it takes {', '.join(EVAL_KEYS)} (the model "
                "comes from the checkpoint)"
            )
        section, _, name = key.partition(".")
        apply_mapping(cfg, {section: {name: value}}, f"--{key}")
    if cfg.train.dtype not in DTYPES or cfg.parallel.device not in DEVICES:
        raise BoostlrError(
            f"train.dtype must be one of {', '.join(DTYPES)} and parallel.device one of "
            f"{', '.join(DEVICES)}"
        )
    if cfg.train.batch_size < 1:
        raise BoostlrError(f"train.batch_size must be >= 1, got {cfg.train.batch_size}")


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    return a.get_vocab(with_added_tokens=True) == b.get_vocab(with_added_tokens=True)


def check_same_tokenizer(model_tok: Tokenizer, dataset: TokenDataset, vocab_size: int) -> None:
    """Refuse data tokenized with another tokenizer: the loss would be meaningless."""
    data_tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    if not same_tokenizer(data_tok, model_tok):
        raise DataError(
            f"dataset {dataset.path} was tokenized with another tokenizer than the model's: "
            "prepare it with boostlr prepare --tokenizer <run>/tokenizer.json, or pass the "
            "run's own --data.path"
        )
    if dataset.vocab_size > vocab_size:
        raise DataError(
            f"dataset {dataset.path} has vocabulary {dataset.vocab_size}, more than the "
            f"model's {vocab_size}: pass a dataset prepared with the model's tokenizer"
        )


def own_dataset(path: Path, cfg: RunConfig) -> Path:
    """The dataset ``path`` was trained on when no ``--data.path`` is given.

    A run or checkpoint names its own (the default corpus when its ``data.path`` is empty:
    prepared here once if need be). An export holds no dataset: the default corpus is
    taken only when it is already prepared with the export's tokenizer (an export of a
    default-corpus run on this machine); otherwise this says so before anything is prepared,
    as a freshly prepared corpus has a tokenizer of its own."""
    if not is_export(path):
        return default_dataset(vocab_size=cfg.data.default_vocab)
    ready = default_dataset_ready(vocab_size=cfg.data.default_vocab)
    if ready is not None and same_tokenizer(
        load_tokenizer(ready / TOKENIZER_FILE), load_tokenizer(path / TOKENIZER_FILE)
    ):
        return ready
    why = "has another tokenizer" if ready else "is not prepared"
    raise DataError(
        f"{path} is an export and holds no dataset, and the default corpus of its vocabulary "
        f"({cfg.data.default_vocab}) {why}: pass "
        "--data.path DIR, a dataset prepared with the export's tokenizer (boostlr prepare "
        f"--input TEXT --out DIR --tokenizer {path / TOKENIZER_FILE})"
    )


def run_eval(
    path: Path,
    split: str = "val",
    max_tokens: int | None = None,
    overrides: list[tuple[str, str]] | None = None,
    progress: bool = True,
) -> EvalResult:
    """Evaluate ``path`` on ``split`` of its own dataset (or ``--data.path``)."""
    cfg = source_config(path)
    apply_eval_overrides(cfg, overrides or [])
    if cfg.data.seq_len > cfg.model.max_seq_len or cfg.data.seq_len < 1:
        raise BoostlrError(
            f"data.seq_len {cfg.data.seq_len} must be in [1, model.max_seq_len "
            f"{cfg.model.max_seq_len}]: pass another --data.seq_len"
        )
    from boostlr.platform import resolve_device

    device = resolve_device(cfg.parallel.device)
    data_path = cfg.data.path or own_dataset(Path(path), cfg)
    model, tokenizer = load_pretrained(path, device=device)
    dataset = TokenDataset(data_path, split)
    check_same_tokenizer(tokenizer, dataset, model.cfg.vocab_size)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if cfg.train.dtype == "bfloat16" else None
    )
    return evaluate_dataset(
        model,
        dataset,
        tokenizer,
        cfg.data.seq_len,
        cfg.train.batch_size,
        max_tokens=max_tokens,
        autocast=autocast,
        progress=progress,
    )
