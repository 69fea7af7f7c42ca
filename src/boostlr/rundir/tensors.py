"""A checkpoint's model tensors, listed from metadata and read one at a time.

:func:`~boostlr.rundir.checkpoint.load_model_state` builds the whole model in memory, which is
what resuming and generation need. Export and inspection only need one tensor at a time (or
none: shapes and dtypes), so they use :class:`ModelTensors`, whose memory is that of the
tensor being read. A checkpoint is a ``torch.distributed.checkpoint`` directory: the model
entries are ``model.<name>`` at their global shape, listed from ``.metadata`` alone.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from boostlr.errors import CheckpointError
from boostlr.rundir import dcp_io
from boostlr.rundir.checkpoint import dcp_tensor_entries
from boostlr.stream_safetensors import TensorInfo

DCP_MODEL_PREFIX = "model."


class ModelTensors:
    """Names, dtypes and global shapes of a checkpoint's model tensors; :meth:`read` loads one.

    Names are the single-device parameter names (``layers.0.self_attn.q_proj.weight``).
    """

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = Path(path)
        try:
            self.infos = self._dcp_infos()
        except (OSError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as exc:
            raise CheckpointError(
                f"cannot read the model entries of checkpoint {self.path} ({exc}): use an "
                "earlier checkpoint"
            ) from None
        if not self.infos:
            raise CheckpointError(
                f"checkpoint {self.path} holds no model tensors: use a checkpoint written by "
                "boostlr train"
            )

    @property
    def numel(self) -> int:
        return sum(info.nbytes // info.dtype.itemsize for info in self.infos.values())

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.infos.values())

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` on CPU (all its shards)."""
        info = self.infos[name]
        key = DCP_MODEL_PREFIX + name
        out = {key: torch.empty(info.shape, dtype=info.dtype)}
        dcp_io.load(out, self.path, None)
        return out[key]

    def _dcp_infos(self) -> dict[str, TensorInfo]:
        return {
            key.removeprefix(DCP_MODEL_PREFIX): TensorInfo(dtype, shape)
            for key, (shape, dtype) in dcp_tensor_entries(self.path).items()
            if key.startswith(DCP_MODEL_PREFIX)
        }
