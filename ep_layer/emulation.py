"""Several EP ranks emulated inside one process on one GPU, for benchmarks and tests.

Each emulated rank gets its own `cuda`-backend Buffer; their buffers map each other directly (no IPC).
Call each operation's send half on every rank first, then the hooks (`return_recv_hook=True`): a
receive half then never waits for a send that has not been launched, so one stream suffices.
"""

from __future__ import annotations

from . import native
from .backends.cuda import CudaBackend
from .buffer import DEFAULT_TIMEOUT_S, Buffer


def emulated_buffers(num_ranks: int, num_rdma_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Buffer]:
    """One Buffer per emulated rank, all on the current GPU."""
    c = native.load()
    bases = [c.alloc_buffer(num_rdma_bytes) for _ in range(num_ranks)]
    return [Buffer.from_backend(CudaBackend(None, rank, num_ranks, num_rdma_bytes, timeout_s, peer_bases=bases))
            for rank in range(num_ranks)]
