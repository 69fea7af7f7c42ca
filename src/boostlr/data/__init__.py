"""Data pipeline: raw text -> tokenizer -> token shards on disk -> training batches."""

from boostlr.data.corpus import (
    default_corpus_documents,
    default_corpus_files,
    discover_files,
    iter_documents,
)
from boostlr.data.loader import BatchLoader, TokenDataset, num_windows, val_batches
from boostlr.data.prepare import (
    default_cache_dir,
    default_dataset,
    load_manifest,
    prepare_dataset,
    validate_dataset,
)
from boostlr.data.tokenizer import (
    EOS_TOKEN,
    eos_id,
    load_tokenizer,
    resolve_tokenizer,
    train_bpe,
)

__all__ = [
    "EOS_TOKEN",
    "BatchLoader",
    "TokenDataset",
    "default_cache_dir",
    "default_corpus_documents",
    "default_corpus_files",
    "default_dataset",
    "discover_files",
    "eos_id",
    "iter_documents",
    "load_manifest",
    "load_tokenizer",
    "num_windows",
    "prepare_dataset",
    "resolve_tokenizer",
    "train_bpe",
    "val_batches",
    "validate_dataset",
]
