"""RMSNorm, computed in fp32 like HF ``LlamaRMSNorm`` so exports give identical logits."""

from __future__ import annotations

import torch
from torch import nn

from boostlr.models.params import in_dtype, local


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional form, shared with tensor-parallel code that holds gathered gains."""
    dtype = x.dtype
    x32 = in_dtype(x, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * in_dtype(x32, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, local(self.weight), self.eps)
