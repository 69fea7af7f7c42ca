"""Batches of fixed-length token windows read straight from memory-mapped shards.

Window ``i`` of a split covers tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: the first
``seq_len`` are inputs, the last ``seq_len`` targets. Windows may cross document and shard
boundaries (documents are separated by EOS), so no token is wasted on padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from boostlr.data.prepare import SPLITS, validate_dataset
from boostlr.errors import DataError
from boostlr.platform import HostToDevice, host_buffer

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenDataset:
    """All shards of one split of a prepared dataset, viewed as one read-only token array."""

    def __init__(self, path: str | Path, split: str) -> None:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        self.path = Path(path).expanduser()
        self.manifest = validate_dataset(self.path)
        self.split = split
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int = self.manifest["eos_id"]
        self.tokenizer_path = self.path / self.manifest["tokenizer_file"]
        dtype = np.dtype(self.manifest["dtype"])
        shards = [s for s in self.manifest["splits"][split]["shards"] if s["tokens"] > 0]
        self._shards = [
            np.memmap(self.path / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
            for s in shards
        ]
        # _starts[k] is the global index of shard k's first token; _starts[-1] is the total.
        self._starts = np.cumsum([0] + [s["tokens"] for s in shards])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as a fresh array, stitched across shards."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) out of range 0..{len(self)}")
        out = np.empty(length, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while done < length:
            offset = start + done - int(self._starts[shard])
            part = self._shards[shard][offset : offset + length - done]
            out[done : done + len(part)] = part
            done += len(part)
            shard += 1
        return out


def num_windows(dataset: TokenDataset, seq_len: int) -> int:
    """How many ``seq_len + 1`` windows fit at stride ``seq_len``."""
    return max(0, (len(dataset) - 1) // seq_len)


def _windows_batch(
    dataset: TokenDataset, windows: np.ndarray, seq_len: int, device: torch.device | None = None
) -> Batch:
    """Inputs and targets of ``windows``, built in host memory fit for ``device``'s copies
    (pinned for a GPU: :func:`~boostlr.platform.host_buffer`)."""
    rows = np.stack([dataset.tokens(int(w) * seq_len, seq_len + 1) for w in windows])
    data = torch.from_numpy(rows)
    if device is None:
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()
    shape = (len(windows), seq_len)
    inputs, targets = host_buffer(shape, data.dtype, device), host_buffer(shape, data.dtype, device)
    return inputs.copy_(data[:, :-1]), targets.copy_(data[:, 1:])


class BatchLoader:
    """Endless, resumable stream of shuffled training batches for one data-parallel rank.

    Every epoch is a permutation of all windows seeded by ``seed + epoch``; each call takes the
    next ``batch_size * dp_size`` windows and rank ``dp_rank`` keeps its own slice, so ranks
    never see the same window in a step and all ranks agree on the schedule without talking.
    An epoch holds a whole number of optimizer steps (``grad_accum`` calls each), so an
    optimizer step takes the same windows at every layout with the same global batch: the
    position is saved in windows, which lets a checkpoint resume at another dp size.

    With a ``device`` the batches come on it: each is built in pinned host memory (on a GPU)
    and its copy is queued one call ahead, so batch N+1 crosses while batch N computes and
    no call waits for the device. The state counts the batches handed out, never the one
    ahead.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum: int = 1,
        device: torch.device | None = None,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        self.dataset, self.batch_size, self.seq_len, self.seed = dataset, batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_windows = num_windows(dataset, seq_len)
        global_batch = batch_size * dp_size * grad_accum
        if self.num_windows < global_batch:
            raise DataError(
                f"{dataset.split} split of {dataset.path} has {len(dataset)} tokens = "
                f"{self.num_windows} windows of seq_len {seq_len}, fewer than the global batch "
                f"{global_batch}; reduce the batch size or seq_len, or add more data"
            )
        self.batches_per_epoch = self.num_windows // global_batch * grad_accum
        self.epoch = 0
        self.position = 0
        self._perm: tuple[int, torch.Tensor] | None = None
        self.device = device
        self._copies = HostToDevice(device) if device is not None else None
        self._ahead: tuple[tuple[int, int], Batch] | None = None  # (epoch, position), batch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        key = (self.epoch, self.position)
        self.position += 1
        if self._copies is None:
            return self._host_batch(*key)
        if self._ahead is not None and self._ahead[0] == key:
            batch = self._ahead[1]
        else:  # the first call, or the state was loaded since
            batch = self._copies.start(self._host_batch(*key))
        # Ready before the next copy is queued: the compute stream waits for this batch's
        # copy only, not for the one that follows.
        batch = self._copies.ready(batch)
        following = (self.epoch + 1, 0) if self.position >= self.batches_per_epoch else None
        following = following or (self.epoch, self.position)
        self._ahead = (following, self._copies.start(self._host_batch(*following)))
        return batch

    def _host_batch(self, epoch: int, position: int) -> Batch:
        """Batch ``position`` of ``epoch`` for this rank, in host memory."""
        global_batch = self.batch_size * self.dp_size
        start = position * global_batch + self.dp_rank * self.batch_size
        windows = self._permutation(epoch)[start : start + self.batch_size].numpy()
        return _windows_batch(self.dataset, windows, self.seq_len, self.device)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.num_windows, generator=gen))
        return self._perm[1]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands; pass to :meth:`load_state_dict` to resume exactly here.

        ``windows`` (consumed this epoch, over all ranks) is layout-free; ``position`` is kept
        for readers of older checkpoints.
        """
        windows = self.position * self.batch_size * self.dp_size
        return {"epoch": self.epoch, "windows": windows, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, position = state.get("epoch"), state.get("position")
        windows = state.get("windows")
        if isinstance(windows, int):
            per_call = self.batch_size * self.dp_size
            if windows % per_call:
                raise DataError(
                    f"the checkpoint's data position ({windows} windows into epoch {epoch}) is "
                    f"not a multiple of batch_size x dp = {per_call}: resume with the run's "
                    "global batch"
                )
            position = windows // per_call
        if not (isinstance(epoch, int) and isinstance(position, int)) or epoch < 0:
            raise DataError(f"bad data loader state {state!r}; the checkpoint is corrupt")
        if not 0 <= position <= self.batches_per_epoch:
            raise DataError(
                f"data loader state position {position} exceeds the {self.batches_per_epoch} "
                "batches per epoch; resume with the same dataset, batch size, seq_len and dp size"
            )
        self.epoch, self.position = epoch, position


def val_batches(
    dataset: TokenDataset,
    batch_size: int,
    seq_len: int,
    max_batches: int,
    device: torch.device | None = None,
) -> list[Batch]:
    """The first ``max_batches`` batches of windows in order (the last may be smaller).

    Fixed rather than shuffled so validation loss is comparable across steps and runs. Kept
    on the host (pinned for a GPU ``device``, so evaluation's copies never wait).
    """
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
    count = min(num_windows(dataset, seq_len), max_batches * batch_size)
    return [
        _windows_batch(dataset, np.arange(start, min(start + batch_size, count)), seq_len, device)
        for start in range(0, count, batch_size)
    ]


class ValidationSet(list):
    """This data-parallel rank's validation batches, and the windows every rank left out.

    Every rank holds the same number of batches, each of ``train.batch_size`` windows: with
    the vocabulary split over dp the evaluation all-gathers hidden states and targets over
    dp, and on NCCL a gather of unequal shapes hangs or corrupts (on gloo it may even pass).
    """

    def __init__(self, batches: list[Batch], dropped: int):
        super().__init__(batches)
        self.dropped = dropped


def split_validation(batches: list[Batch], batch_size: int, dp_size: int, dp_rank: int):
    """This rank's share of the validation batches: whole batches only, as many per rank.

    The first ``k x dp`` whole batches are dealt round-robin; a short last batch and the
    whole batches that do not make up a round are left out and counted (``dropped``
    windows: the metrics row's ``val_dropped``).
    """
    whole = [b for b in batches if len(b[0]) == batch_size]
    usable = len(whole) // dp_size * dp_size
    dropped = sum(len(b[0]) for b in batches) - usable * batch_size
    return ValidationSet(whole[:usable][dp_rank::dp_size], dropped), usable
