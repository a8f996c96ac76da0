"""ep_layer/latency.py and `Buffer.latency_stats()` on the reference backend (CPU, 1 and 2 gloo ranks).

The histogram type on its own (buckets, cumulative counts, sums, pickling), then the Buffer: every
completed dispatch / combine counts exactly once whatever the mode (plain, hook, async_finish), calls
that raise do not count, and each recorded latency lies inside the host wall time measured around the
call's send and receive halves, so the time between a send and its hook is provably left out. The
cuda backend's device-side histograms are tested in tests/test_buffer_cuda.py; its host-side part
(calls whose timing records the kernels have not added to the histogram yet) here.
"""

from __future__ import annotations

import pickle
import re
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks

from ep_layer import Buffer
from ep_layer.latency import (
    BOUNDS_NS,
    BOUNDS_S,
    NUM_BUCKETS,
    OPS,
    HostLatencyRecorder,
    LatencyHistogram,
    bucket_of,
)

ROOT = Path(__file__).resolve().parent.parent
T, H, E, K = 8, 128, 4, 2
HOOK_GAP_S = 0.2  # work between a send and its hook, longer than any CPU call here


# ---------------------------------------------------------------------------- the histogram type
def test_bounds_are_ascending_microseconds_to_100_ms_and_fit_the_kernels():
    assert all(type(b) is int and b > 0 for b in BOUNDS_NS)
    assert list(BOUNDS_NS) == sorted(set(BOUNDS_NS))
    assert BOUNDS_NS[0] == 5_000 and BOUNDS_NS[-1] == 100_000_000
    assert tuple(b / 1e9 for b in BOUNDS_NS) == BOUNDS_S and len(BOUNDS_NS) + 1 == NUM_BUCKETS
    header = (ROOT / "csrc" / "ll_common.cuh").read_text()
    (limit,) = re.findall(r"constexpr int kMaxLatencyBounds = (\d+);", header)
    assert len(BOUNDS_NS) <= int(limit), "the kernels compare a latency with at most kMaxLatencyBounds bounds"
    assert OPS == ("dispatch", "combine")  # the kernels' Op order (csrc/ll_common.cuh: kDispatch, kCombine)


def test_bucket_of_is_prometheus_le():
    assert bucket_of(0) == 0
    for i, bound in enumerate(BOUNDS_NS):
        assert bucket_of(bound) == i, "a latency equal to a bound is in that bound's bucket (le)"
        assert bucket_of(bound + 1) == i + 1
    assert bucket_of(10**12) == NUM_BUCKETS - 1  # +Inf


def test_recorder_snapshot_cumulative_sum_and_add():
    rec = HostLatencyRecorder()
    assert rec.snapshot() == {op: LatencyHistogram.empty() for op in OPS}
    samples = [1, 5_000, 5_001, 99_999, 3 * 10**9]
    for ns in samples:
        rec.record("dispatch", ns)
    rec.record("combine", 12_345)
    snap = rec.snapshot()
    d, c = snap["dispatch"], snap["combine"]
    assert d.count == len(samples) and c.count == 1
    assert d.sum_s == pytest.approx(sum(samples) / 1e9) and c.sum_s == pytest.approx(12_345e-9)
    assert d.counts[0] == 2 and d.counts[1] == 1 and d.counts[-1] == 1
    cumulative = d.cumulative()
    assert [b for b, _ in cumulative] == [*BOUNDS_S, float("inf")]
    assert cumulative[-1][1] == d.count and all(a <= b for (_, a), (_, b) in pairwise(cumulative))
    assert dict(cumulative)[100e-6] == 4  # 1, 5000, 5001, 99999 ns are <= 100 us
    both = d + c
    assert both.count == 6 and both.sum_s == pytest.approx(d.sum_s + c.sum_s)
    assert sum([d, c], LatencyHistogram.empty()) == both
    assert pickle.loads(pickle.dumps(both)) == both  # crosses process boundaries inside EPStats
    rec.record("dispatch", 1)
    assert snap["dispatch"].count == len(samples), "a snapshot does not change afterwards"


def test_histogram_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="counts"):
        LatencyHistogram(BOUNDS_S, (0,) * len(BOUNDS_S), 0.0)
    with pytest.raises(ValueError, match="bounds"):
        LatencyHistogram.empty() + LatencyHistogram((1.0,), (0, 0), 0.0)


def test_cuda_backend_adds_the_calls_the_kernels_have_not_accounted_yet():
    """CudaBackend.latency_stats() reads the launch counters and the timing records ([op][seq % 4]:
    send_start, send_end, ~recv_start, recv_end) and adds the last two calls of each op whose receive
    ran (the send of call n adds call n - 2 on the device), the way account_previous_call would."""
    from ep_layer.backends.cuda import _unaccounted_rows

    def record(send: tuple[int, int], recv: tuple[int, int] | None) -> list[int]:
        return [*send, ~recv[0] & (1 << 64) - 1, recv[1]] if recv else [*send, 0, 0]

    def launches(calls: int) -> int:
        return calls << 20

    done = record((1, 2), (3, 4))  # a completed call, already added on the device when not one of the last two
    timing = [
        launches(6), launches(3),
        # dispatch: calls 5 and 6 are the last two; 6 sent without its receive yet
        *record((100, 5_100), (6_000, 7_000)),  # call 4 (and 8, ...): accounted by the send of call 6
        *record((200, 300), (400, 500)),  # call 5: 0.1 us + 0.1 us
        *record((1_000, 2_000), None),  # call 6: no receive yet
        *done,  # call 3
        # combine: calls 2 and 3
        *done,  # call 4: none yet
        *record((10, 20), (30, 30 + 10**9)),  # call 5 ... : not one of the last two
        *record((10, 20), (30, 30 + 10**9)),  # call 2: a receive that waited 1 s (timeout)
        *record((5_000, 4_000), (8_000, 7_000)),  # call 3: spans never go negative (device: span())
    ]
    dispatch, combine = _unaccounted_rows(timing)
    assert len(dispatch) == len(combine) == NUM_BUCKETS + 1  # buckets, then the sum in ns
    assert dispatch[bucket_of(200)] == 1 and sum(dispatch[:-1]) == 1 and dispatch[-1] == 200
    assert combine[NUM_BUCKETS - 1] == 1 and combine[0] == 1 and sum(combine[:-1]) == 2
    assert combine[-1] == 10 + 10**9
    first_only, none = _unaccounted_rows([launches(1), 0] + done * 8)
    assert sum(first_only[:-1]) == 1 and first_only[-1] == 2, "call 1 of an op lives in record 1"
    assert none == [0] * (NUM_BUCKETS + 1), "an op with no calls adds nothing"


# ---------------------------------------------------------------------------- Buffer, reference backend
class Calls:
    """Runs dispatch + combine pairs on a Buffer in one of its modes and keeps, per op, how many calls
    completed and the host wall time spent inside their send and receive halves (from the outside)."""

    def __init__(self, buf: Buffer, rank: int, num_ranks: int) -> None:
        self.buf = buf
        g = torch.Generator().manual_seed(rank)
        n = T - rank  # ranks send different numbers of tokens
        self.x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        self.idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
            torch.empty(0, K, dtype=torch.int64)
        self.w = torch.rand(n, K, generator=g)
        self.e_l = E // num_ranks
        self.count = dict.fromkeys(OPS, 0)
        self.wall_ns = dict.fromkeys(OPS, 0)

    def _timed(self, op: str, call):
        start = time.perf_counter_ns()
        out = call()
        self.wall_ns[op] += time.perf_counter_ns() - start
        return out

    def pair(self, mode: str) -> None:
        """One dispatch and one combine; mode "plain", "hook" (HOOK_GAP_S of other work before each
        hook) or "async" (async_finish)."""
        hook, asyn = mode == "hook", mode == "async"
        recv_x, _, handle, _, dispatch_hook = self._timed("dispatch", lambda: self.buf.low_latency_dispatch(
            self.x, self.idx, T, E, use_fp8=False, return_recv_hook=hook, async_finish=asyn))
        if hook:
            time.sleep(HOOK_GAP_S)
            self._timed("dispatch", dispatch_hook)
        self.count["dispatch"] += 1
        y = recv_x * 2
        _, _, combine_hook = self._timed("combine", lambda: self.buf.low_latency_combine(
            y, self.idx, self.w, handle, return_recv_hook=hook, async_finish=asyn))
        if hook:
            time.sleep(HOOK_GAP_S)
            self._timed("combine", combine_hook)
        self.count["combine"] += 1

    def check(self, where: str) -> None:
        stats = self.buf.latency_stats()
        assert set(stats) == set(OPS), where
        for op in OPS:
            h = stats[op]
            assert h.bounds_s == BOUNDS_S, where
            assert h.count == self.count[op], f"{where} {op}: {h.count} recorded, {self.count[op]} calls"
            assert (h.sum_s > 0 or h.count == 0) and h.sum_s <= self.wall_ns[op] / 1e9, \
                f"{where} {op}: recorded {h.sum_s} s, wall time inside the halves {self.wall_ns[op] / 1e9} s"


def rank_latency(rank: int, num_ranks: int) -> None:
    group = None if num_ranks == 1 else torch.distributed.group.WORLD
    buf = Buffer(group, low_latency_mode=True, backend="reference", timeout_s=30)
    calls = Calls(buf, rank, num_ranks)
    calls.check("fresh buffer")
    for mode in ("plain", "async", "plain"):
        calls.pair(mode)
        calls.check(mode)
    before = buf.latency_stats()
    calls.pair("hook")
    calls.check("hook")  # were the gaps counted, the sums would exceed the wall time inside the halves
    after = buf.latency_stats()
    for op in OPS:
        assert after[op].sum_s - before[op].sum_s < HOOK_GAP_S, f"{op}: the time before the hook was counted"

    with pytest.raises(ValueError, match="x"):  # refused by the argument checks: not a call
        buf.low_latency_dispatch(calls.x.float(), calls.idx, T, E)
    calls.check("after a refused call")
    buf.clean_low_latency_buffer(T, H, E)
    calls.pair("plain")
    calls.check("after clean (cumulative since the Buffer was made)")
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroy"):
        buf.latency_stats()


def test_reference_latency_one_rank_without_group():
    rank_latency(0, 1)


def test_reference_latency_two_gloo_ranks():
    run_ranks(rank_latency, 2, timeout_s=120)


def test_two_buffers_keep_their_own_stats():
    a = Buffer(None, low_latency_mode=True, backend="reference")
    b = Buffer(None, low_latency_mode=True, backend="reference")
    calls = Calls(a, 0, 1)
    calls.pair("plain")
    calls.check("buffer a")
    assert b.latency_stats() == {op: LatencyHistogram.empty() for op in OPS}
