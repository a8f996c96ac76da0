"""Several EP ranks emulated inside one process on one GPU, for benchmarks and tests.

Each emulated rank gets its own `cuda`-backend Buffer; their buffers map each other directly (no IPC).
Call each operation's send half on every rank first, then the hooks (`return_recv_hook=True`): a
receive half then never waits for a send that has not been launched, so one stream suffices. With
`RankStreams` each rank's kernels of one phase run on a stream of its own, side by side on the GPU as
they would on separate GPUs, instead of one after another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from . import native
from .backends.cuda import CudaBackend
from .buffer import DEFAULT_TIMEOUT_S, Buffer
from .checks import expect
from .layout import allocated_low_latency_bytes

T = TypeVar("T")


def emulated_buffers(num_ranks: int, num_rdma_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                     gpu_share: int = 1, shrink: bool = False, num_nvl_bytes: int = 0) -> list[Buffer]:
    """One Buffer per emulated rank, all on the current GPU. Each rank sizes its dispatch grids for
    1/`gpu_share` of the GPU: `num_ranks` when the ranks' kernels run side by side (`RankStreams`), or to
    give each rank the share of the hardware it stands for; 1 (each takes all of it) when they run one
    after another. `shrink`: rank masking, as Buffer(enable_shrink=True). `num_nvl_bytes` > 0: normal
    mode too, whose calls must run side by side (each rank's exchange waits for the others) and whose
    dispatches must not wait for the host (`num_worst_tokens`, or a handle)."""
    expect(1 <= gpu_share <= num_ranks, "gpu_share", f"in [1, {num_ranks}]", gpu_share)
    c = native.load()
    ll_bytes = allocated_low_latency_bytes(num_rdma_bytes)
    bases = [c.alloc_buffer(ll_bytes) for _ in range(num_ranks)]
    nvl_bases = [c.alloc_buffer(num_nvl_bytes) for _ in range(num_ranks)] if num_nvl_bytes else None
    return [Buffer.from_backend(CudaBackend(None, rank, num_ranks, num_rdma_bytes, timeout_s, shrink=shrink,
                                            peer_bases=bases, gpu_share=gpu_share, num_nvl_bytes=num_nvl_bytes,
                                            nvl_peer_bases=nvl_bases))
            for rank in range(num_ranks)]


_streams_of_device: dict[int, list[torch.cuda.ExternalStream]] = {}


def _dedicated_streams(n: int) -> list[torch.cuda.ExternalStream]:
    """`n` streams of the current GPU that no other code is handed. Not torch's pool: it hands its 32
    streams out round-robin, so past 32 requests a rank's stream can be the one torch.cuda.graph captures
    on, and a captured phase then runs two ranks one after the other. Kept for the process, as the
    pool's are."""
    device = torch.cuda.current_device()
    streams = _streams_of_device.setdefault(device, [])
    while len(streams) < n:
        streams.append(torch.cuda.ExternalStream(native.load().create_stream(), device=device))
    return streams[:n]


class RankStreams:
    """One CUDA stream per emulated rank. `run(calls)` runs calls[r]() on rank r's stream, all of them
    after the work already queued on the current stream, which then waits for all of them: one phase
    (every rank's send half, or every rank's hook) with the ranks' kernels running concurrently.

    Tensors a call allocates belong to its rank's stream; keep them until the current stream has used
    them (or synchronise) before dropping them. Within a phase no rank's kernel waits for another's:
    sends never wait, and a hook's receive waits only for sends of the phase before. Rank r's stream is
    the same one in every RankStreams of the process."""

    def __init__(self, num_ranks: int) -> None:
        self.streams = _dedicated_streams(num_ranks)

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        if len(calls) != len(self.streams):
            raise ValueError(f"calls: expected one per rank ({len(self.streams)}), got {len(calls)}")
        current = torch.cuda.current_stream()
        results = []
        for stream, call in zip(self.streams, calls):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                results.append(call())
        for stream in self.streams:
            current.wait_stream(stream)
        return results


def each_rank(calls: Sequence[Callable[[], T]], streams: RankStreams | None = None) -> list[T]:
    """One phase of every emulated rank: side by side on the ranks' streams, or (`streams=None`) one
    after another on the current stream."""
    return streams.run(calls) if streams else [call() for call in calls]
