"""Dispatch / combine latency histograms: the fixed bucket bounds (one source of truth for the host and
the kernels), the histogram type `Buffer.latency_stats()` returns, and the host-side recorder.

The latency of one call is the time it occupies the stream: its send half plus its receive half, each
from when it starts to when it ends, waits for peer ranks included. With `return_recv_hook=True`
the work between the send and the hook is not counted.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

OPS = ("dispatch", "combine")

# Upper bounds of the buckets in nanoseconds, ascending; one more bucket (+Inf) follows. Microsecond
# steps where the cuda kernels live (one call: ~10-100 us), coarser up to where the reference
# backend and stalled peers are (milliseconds).
BOUNDS_NS: tuple[int, ...] = (
    5_000, 10_000, 15_000, 20_000, 25_000, 30_000, 40_000, 50_000, 75_000, 100_000, 150_000, 200_000, 300_000,
    500_000, 750_000, 1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000, 100_000_000,
)
BOUNDS_S: tuple[float, ...] = tuple(ns / 1e9 for ns in BOUNDS_NS)
NUM_BUCKETS = len(BOUNDS_NS) + 1  # the last one is +Inf


def bucket_of(ns: int) -> int:
    """Index of the bucket that holds a latency of `ns` nanoseconds: the first bound >= ns (Prometheus' `le`)."""
    return bisect.bisect_left(BOUNDS_NS, ns)


@dataclass(frozen=True)
class LatencyHistogram:
    """Latencies of one operation: `counts[i]` calls fell in bucket i (not cumulative; the last bucket
    is above every bound), `sum_s` is their total in seconds. Picklable; add two with `+`."""

    bounds_s: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds_s) + 1:
            raise ValueError(f"counts: expected {len(self.bounds_s) + 1} buckets (the bounds and +Inf), "
                             f"got {len(self.counts)}")

    @classmethod
    def empty(cls) -> LatencyHistogram:
        return cls(BOUNDS_S, (0,) * NUM_BUCKETS, 0.0)

    @classmethod
    def from_ns(cls, counts: list[int], sum_ns: int) -> LatencyHistogram:
        """From per-bucket counts over BOUNDS_NS and a sum in nanoseconds (how backends keep them)."""
        return cls(BOUNDS_S, tuple(int(c) for c in counts), sum_ns / 1e9)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound in seconds, calls at or below it) for every bucket, ending with (inf, count):
        Prometheus' `_bucket{le}` series."""
        out, running = [], 0
        for bound, n in zip((*self.bounds_s, math.inf), self.counts):
            running += n
            out.append((bound, running))
        return out

    def __add__(self, other: LatencyHistogram) -> LatencyHistogram:
        if not isinstance(other, LatencyHistogram):
            return NotImplemented
        if other.bounds_s != self.bounds_s:
            raise ValueError("LatencyHistogram: cannot add histograms with different bucket bounds")
        return LatencyHistogram(self.bounds_s, tuple(a + b for a, b in zip(self.counts, other.counts)),
                                self.sum_s + other.sum_s)


class HostLatencyRecorder:
    """Per-operation histograms of latencies measured on the host (the reference backend's)."""

    def __init__(self) -> None:
        self._counts = {op: [0] * NUM_BUCKETS for op in OPS}
        self._sum_ns = dict.fromkeys(OPS, 0)

    def record(self, op: str, ns: int) -> None:
        self._counts[op][bucket_of(ns)] += 1
        self._sum_ns[op] += ns

    def snapshot(self) -> dict[str, LatencyHistogram]:
        return {op: LatencyHistogram.from_ns(self._counts[op], self._sum_ns[op]) for op in OPS}
