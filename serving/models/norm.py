"""RMSNorm and the token embedding, as DeepSeek-V3 (and transformers) compute them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import rms_norm_triton


class RMSNorm(nn.Module):
    """x / rms(x) in float32, rounded back to x's dtype, then times the weight (transformers' order). On a
    GPU with Triton, in one kernel (serving.models.rms_norm_triton)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype and rms_norm_triton.available():
            return rms_norm_triton.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Embedding(nn.Module):
    """Token id -> row of the [vocab, hidden] table."""

    def __init__(self, vocab: int, dim: int, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(vocab, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
