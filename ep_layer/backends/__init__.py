"""Buffer backends: `reference` (torch.distributed) and `cuda` (our kernels over CUDA IPC)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .. import layout, native
from .base import Backend, DispatchResult, DispatchSpec, Handle, RecvX, RowsInPlace
from .reference import ReferenceBackend

BACKENDS = ("auto", "cuda", "reference")
TRANSPORTS = ("auto", "ipc", "nvshmem")  # the cuda backend's ways of sharing the ranks' buffers

__all__ = ["BACKENDS", "TRANSPORTS", "Backend", "DispatchResult", "DispatchSpec", "Handle", "RecvX", "RowsInPlace",
           "create_backend", "resolve_backend"]


def resolve_backend(name: str, *, one_node: bool = True, device: torch.device | str | None = None,
                    num_ranks: int = 1) -> str:
    """The backend `name` stands for, the one place `auto` is decided: `cuda` where our kernels are
    built, a GPU is present, the caller's tensors live on a GPU (`device`; None: wherever they may be),
    the `num_ranks` ranks are no more than the kernels take (layout.MAX_RANKS), and they share one node
    (CUDA IPC) or NVSHMEM can reach across nodes (native.nvshmem_available); else `reference`."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    on_gpu = device is None or torch.device(device).type == "cuda"
    reachable = (one_node or native.nvshmem_available()) and num_ranks <= layout.MAX_RANKS
    return "cuda" if reachable and on_gpu and native.available() and torch.cuda.is_available() else "reference"


def create_backend(name: str, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                   num_rdma_bytes: int, timeout_s: float, *, shrink: bool = False, num_nvl_bytes: int = 0,
                   transport: str = "auto") -> Backend:
    """The backend resolve_backend(name) names, for this rank of `group`; `num_nvl_bytes` sizes the cuda
    backend's normal-mode buffer (the reference backend needs none); `transport` is how the cuda backend
    shares its buffers: CUDA IPC ("ipc"), NVSHMEM ("nvshmem"), or "auto": NVSHMEM when the ranks span
    several hosts and `num_rdma_bytes` > 0 (DeepEP's convention), else CUDA IPC."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    # Only where the cuda backend may run: the question is a collective, and no answer changes `reference`.
    may_be_cuda = name != "reference" and native.available() and torch.cuda.is_available()
    spans_hosts = transport == "auto" and may_be_cuda and num_ranks > 1 and _spans_hosts(group, num_ranks)
    name = resolve_backend(name, one_node=not spans_hosts, num_ranks=num_ranks)
    if name == "reference":
        if transport == "nvshmem":
            raise ValueError("transport: 'nvshmem' is a transport of the cuda backend, and this Buffer's backend is "
                             "'reference'")
        return ReferenceBackend(group, rank, num_ranks, num_rdma_bytes, timeout_s, shrink)
    if not torch.cuda.is_available():
        raise ValueError("backend: 'cuda' needs a CUDA GPU, and torch sees none")
    native.load()  # raises with the reason the extension is missing
    from .cuda import CudaBackend

    if transport == "auto":
        transport = "nvshmem" if spans_hosts and num_rdma_bytes > 0 else "ipc"
    return CudaBackend(group, rank, num_ranks, num_rdma_bytes, timeout_s, shrink=shrink, num_nvl_bytes=num_nvl_bytes,
                       transport=transport)


def _spans_hosts(group: dist.ProcessGroup | None, num_ranks: int) -> bool:
    """Whether the group's ranks run on more than one host (a collective over `group`)."""
    hosts: list = [None] * num_ranks
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) > 1
