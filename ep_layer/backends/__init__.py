"""Buffer backends: `reference` (torch.distributed) and `cuda` (our kernels over CUDA IPC)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import native
from .base import Backend, DispatchResult, DispatchSpec, Handle, RecvX, RowsInPlace
from .reference import ReferenceBackend

BACKENDS = ("auto", "cuda", "reference")

__all__ = ["BACKENDS", "Backend", "DispatchResult", "DispatchSpec", "Handle", "RecvX", "RowsInPlace", "create_backend"]


def create_backend(name: str, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                   num_rdma_bytes: int, timeout_s: float) -> Backend:
    """`auto` picks `cuda` where our kernels are built and a GPU is present, else `reference`."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "cuda" if native.available() and torch.cuda.is_available() else "reference"
    if name == "reference":
        return ReferenceBackend(group, rank, num_ranks, num_rdma_bytes, timeout_s)
    if not torch.cuda.is_available():
        raise ValueError("backend: 'cuda' needs a CUDA GPU, and torch sees none")
    native.load()  # raises with the reason the extension is missing
    from .cuda import CudaBackend

    return CudaBackend(group, rank, num_ranks, num_rdma_bytes, timeout_s)
