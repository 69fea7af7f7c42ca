"""Tokenizers: train a small byte-level BPE, or load an existing ``tokenizer.json``.

A spec string selects one: ``bpe:VOCAB`` trains a fresh byte-level BPE on the corpus, anything
else is a path to a ``tokenizer.json`` file or a Hugging Face tokenizer directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from boostlr.errors import DataError

EOS_TOKEN = "<|endoftext|>"
# Used when a loaded tokenizer lacks EOS_TOKEN (e.g. Llama/T5 style vocabularies).
_FALLBACK_EOS_TOKENS = ("</s>", "<|end_of_text|>", "<eos>")
# 256 byte symbols + the EOS token + a few merges; smaller cannot encode anything usefully.
MIN_VOCAB = 260


def train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose id 0 is ``EOS_TOKEN``; any string round-trips losslessly.

    The tokenizers library pre-tokenises and counts the documents on all cores (its Rust
    threads take them from this iterator a few hundred at a time), then runs the merges. Its
    own progress bars stay off: ``boostlr prepare`` draws one bar per phase itself.
    """
    _check_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"BPE vocab size {vocab_size} is too small; use at least {MIN_VOCAB} (e.g. bpe:4096)"
        )


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Load ``spec`` (a tokenizer.json file, or a directory containing one)."""
    path = Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"tokenizer file {file} not found; pass bpe:VOCAB to train one, or a path to a "
            "tokenizer.json file or a directory containing it"
        )
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise DataError(
            f"cannot load tokenizer {file}: {exc}; check it is a tokenizer.json"
        ) from exc
    eos_id(tok)
    return tok


def parse_bpe_spec(spec: str) -> int | None:
    """Vocab size of a ``bpe:VOCAB`` spec, or None if ``spec`` is a path."""
    if not spec.startswith("bpe:"):
        return None
    value = spec.removeprefix("bpe:")
    if not value.isdigit():
        raise DataError(
            f"bad tokenizer spec {spec!r}; write bpe:VOCAB with an integer, e.g. bpe:4096"
        )
    vocab = int(value)
    _check_vocab(vocab)
    return vocab


def resolve_tokenizer(spec: str, documents_factory: Callable[[], Iterable[str]]) -> Tokenizer:
    """Train (``bpe:VOCAB``, reading ``documents_factory()``) or load the tokenizer ``spec``."""
    vocab = parse_bpe_spec(spec)
    if vocab is None:
        return load_tokenizer(spec)
    return train_bpe(documents_factory(), vocab)


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token that separates documents in the token stream."""
    for token in (EOS_TOKEN, *_FALLBACK_EOS_TOKENS):
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(
        f"tokenizer has no end-of-document token ({EOS_TOKEN} or </s>); "
        "add one to the tokenizer or train a new one with bpe:VOCAB"
    )
