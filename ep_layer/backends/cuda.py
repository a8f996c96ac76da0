"""The `cuda` backend: our kernels (csrc/) over buffers that the ranks of one node map through CUDA IPC.

A dispatch takes its outputs from a recycled set (_OutputSet) or makes a new one, and each call launches
one kernel per half (a call without a hook: one kernel for both); nothing waits on the host, so every
call can be captured in a CUDA graph.
Failures inside kernels (a peer that never arrives, ranks that disagree, bad expert ids) are recorded
on the device, flagged in host-mapped memory, and raised at the next call or at `check()`; a kernel
never waits longer than `timeout_s`. Latency stats are kept on the device too: the kernels time
themselves (globaltimer) into a record per call, with fire-and-forget atomics that nothing waits for;
block 0 of the send kernel two calls later (the one that reuses the call's buffer half) adds the
record to a histogram in device memory after its own work. `latency_stats()` adds the calls whose
records are still there (csrc/ll_common.cuh: Timing).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from .. import latency, layout, native, streams
from ..checks import expect
from ..errors import EPTimeoutError, overlap_signal_timeout
from ..kernel_args import CombinePointers, DispatchPointers
from ..latency import LatencyHistogram
from ..quant import FP8_GROUP, UE8M0_PACK
from . import nvshmem_heap
from .base import Backend, DispatchResult, DispatchSpec, Handle, ReceiveHalf, RowsInPlace, SendSignals
from .cuda_normal import CudaNormalMode
from .device_errors import take_recorded_error
from .device_tensor import device_tensor
from .normal import NormalCombineArgs, NormalDispatchArgs, NormalDispatchResult

MAX_HIDDEN = 16384
_OPS = ("low_latency_dispatch", "low_latency_combine")  # by the kernels' Op; latency.OPS is in the same order
_TIMEOUT, _MISMATCH, _BAD_EXPERT, _SIGNAL_TIMEOUT = 1, 2, 3, 4  # csrc/ll_common.cuh: ErrorCode
_U64 = (1 << 64) - 1
_bounds_on_device: dict[int, tuple[int, ...]] = {}  # device index -> bounds in the kernels' __constant__ tables


def _set_latency_bounds(c, device: torch.device) -> None:
    """Give the kernels latency.BOUNDS_NS (once per device: __constant__ memory is per device)."""
    if _bounds_on_device.get(device.index) != latency.BOUNDS_NS:
        with torch.cuda.device(device):
            c.set_latency_bounds(list(latency.BOUNDS_NS))
        _bounds_on_device[device.index] = latency.BOUNDS_NS


_TIMING_RECORDS = 4  # per op, by sequence number (ll_common.cuh: kTimingRecords)
_LAUNCH_SHIFT = 20  # a launch counter is 1 << 20 per call (ll_common.cuh: kLaunchShift)


def _record_ns(record: tuple[int, int, int, int]) -> int | None:
    """The latency of the call in one timing record (send_start, send_end, ~recv_start, recv_end), or
    None when its receive has not run. Mirrors account_previous_call."""
    send_start, send_end, recv_start_inverted, recv_end = record
    if recv_start_inverted == 0:
        return None
    recv_start = ~recv_start_inverted & _U64
    return max(send_end - send_start, 0) + max(recv_end - recv_start, 0)


def _unaccounted_rows(timing: list[int]) -> list[list[int]]:
    """Per op: the calls in `timing` (read_timing: both launch counters, then [op][record][4 fields]) not yet
    in the device histogram, per bucket, then their sum in ns (the device histogram's layout). The send
    of call n adds call n - 2 on the device, so the last two calls of each op are the ones left."""
    rows = [[0] * (latency.NUM_BUCKETS + 1) for _ in latency.OPS]
    for op, row in enumerate(rows):
        last = timing[op] >> _LAUNCH_SHIFT  # sequence number of the op's last call, 0 = none
        for seq in range(max(1, last - 1), last + 1):
            first = len(latency.OPS) + (op * _TIMING_RECORDS + seq % _TIMING_RECORDS) * 4
            ns = _record_ns(tuple(timing[first:first + 4]))
            if ns is not None:
                row[latency.bucket_of(ns)] += 1
                row[-1] += ns
    return rows


def _nothing() -> None:
    """The receive half of a call whose one kernel did both halves."""


def _overlap(c: object, signals: SendSignals | None, send_sms: int | None) -> object:
    """A combine launch's _C.CombineOverlap: its single-batch-overlap signals and its cap on send blocks
    (0 where not given); the caller passes None instead when it has neither."""
    fields = dict(signals=0, signal_rows=0, signals_per_expert=0, signal_threshold=0) if signals is None else dict(
        signals=signals.signals.data_ptr(), signal_rows=signals.rows, signals_per_expert=signals.per_expert,
        signal_threshold=signals.threshold)
    return c.CombineOverlap(**fields, send_sms=send_sms or 0)


def _data_ptr(t: torch.Tensor | None) -> int:
    """A tensor's device address for the kernels; 0 (none) for an optional tensor not given."""
    return t.data_ptr() if t is not None else 0


def _ranks(mask: int) -> list[int]:
    return [r for r in range(layout.MAX_RANKS) if mask >> r & 1]


class _OutputSet:
    """One set of dispatch outputs, and their device addresses for the kernels. A set is recycled by a
    later dispatch of its shape once nothing but the backend refers to its tensors (the caller holds
    none of the returned objects and no view of their memory), no hook that uses it is pending, and the
    later dispatch runs on the set's own stream (its first dispatch's): the caller sees fresh tensors, as from
    torch's allocator, without an allocation's host time per call. Stream order puts the later dispatch after
    every use on the set's own stream; a use on another stream (FusedMoE's combine runs on a side stream of its
    own) records a fence there, which the later dispatch waits for (`join_uses`) before it writes the set."""

    __slots__ = ("_baseline", "_fences", "_storages", "_unjoined", "_watched", "combines", "device_index",
                 "dispatches", "ints", "layout_range", "pending", "pointers", "recv_count", "recv_x", "src_info",
                 "stream")
    RETIRED = -1  # `stream` once the set was used on another stream in a CUDA graph capture: never recycled

    def __init__(self, recv_x: object, recv_count: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor,
                 ints: torch.Tensor, pointers: DispatchPointers, owned: list[torch.Tensor], stream: int,
                 device_index: int) -> None:
        self.recv_x, self.recv_count, self.src_info, self.layout_range = recv_x, recv_count, src_info, layout_range
        self.ints = ints  # int32: the tickets of the dispatch and of its combine, recv_count, src_info, combine_map
        self.pointers = pointers
        # The calls into this set, prepared once (_C.PreparedDispatch, _C.PreparedCombine), by (tokens, top-k).
        self.dispatches: dict[tuple[int, int], object] = {}
        self.combines: dict[tuple[int, int], object] = {}
        self.stream, self.device_index = stream, device_index
        self.pending = 0  # hooks not yet launched that write or read the set
        # By stream other than the set's own: an event recorded there after the set's last use (its fence), and
        # whether one was recorded since the set's own stream last waited for them.
        self._fences: dict[int, torch.cuda.Event] = {}
        self._unjoined = False
        # A caller may hold a returned object itself (more Python references to it) or a view of its
        # memory (more tensors on its storage): each is compared with what the set alone holds.
        parts = recv_x if isinstance(recv_x, tuple) else (recv_x.offsets, recv_x.scales) \
            if isinstance(recv_x, RowsInPlace) else ()
        self._watched = [o for o in (recv_x, *parts, recv_count, src_info, layout_range) if o is not None]
        self._storages = [t.untyped_storage()._cdata for t in owned]
        self._baseline: list[int] = []

    def settle(self) -> None:
        """Record the references the set alone holds; call it once nothing else refers to its parts."""
        self._baseline = self._references()

    def _references(self) -> list[int]:
        return [*map(sys.getrefcount, self._watched), *map(_use_count, self._storages)]

    def free_on(self, stream: int) -> bool:
        # Inside a graph capture the fences cannot be waited for: events recorded outside it are not its work.
        return (self.pending == 0 and stream == self.stream and self._references() == self._baseline
                and not (self._unjoined and torch._C._cuda_isCurrentStreamCapturing()))

    def used_on(self, stream: int) -> None:
        """Our kernels read or wrote the set on `stream`, the current stream: call it right after their launch."""
        if stream == self.stream:
            return
        if torch._C._cuda_isCurrentStreamCapturing():  # a fence recorded in a capture is the graph's alone
            self.stream = _OutputSet.RETIRED
            return
        self._fences[stream] = _record_fence(self.device_index, self._fences.get(stream))
        self._unjoined = True

    def join_uses(self) -> None:
        """Make the current stream, the set's own, wait for the set's uses on other streams (before writing it)."""
        if self._unjoined:
            _wait_fences(self.device_index, self._fences.values())
            self._unjoined = False


def _record_fence(device_index: int, event: torch.cuda.Event | None) -> torch.cuda.Event:
    """`event` (a new one where None) recorded on the current stream of device `device_index`."""
    event = torch._C._CudaEventBase() if event is None else event
    event.record(streams.current_stream(device_index))
    return event


def _wait_fences(device_index: int, fences: Iterable[torch.cuda.Event]) -> None:
    """Make the current stream of device `device_index` wait for each event's last record."""
    stream = streams.current_stream(device_index)
    for event in fences:
        event.wait(stream)


_use_count = torch._C._storage_Use_Count
_MAX_OUTPUT_SETS = 4  # per shape: two micro-batches' results held, plus the one being made


class _CombineOutputs:
    """The combined tensors of one shape, each handed out again once the caller holds neither it nor a view
    of its memory and the new combine runs on the stream of its last one (whose order then puts the new
    write after every earlier use there): a fresh tensor to the caller, as torch's allocator would give
    one, without an allocation's host time. At most _MAX_OUTPUT_SETS are kept; the least recently used goes."""

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self._make = make
        # Least recently used first: [tensor, its storage (_cdata, read without a Storage object), stream,
        # (references, storage uses) when only the pool holds it].
        self._entries: list[list] = []

    def take(self, stream: int) -> torch.Tensor:
        entries = self._entries
        for i, (tensor, storage, on, baseline) in enumerate(entries):
            # `tensor` here adds one reference to the baseline's (taken with the same local binding).
            if on == stream and (sys.getrefcount(tensor), _use_count(storage)) == baseline:
                if i + 1 < len(entries):
                    entries.append(entries.pop(i))  # most recently used last
                return tensor
        if len(entries) == _MAX_OUTPUT_SETS:
            entries.pop(0)
        with torch.inference_mode(False):  # recycled across calls: usable in and out of inference mode
            tensor = self._make()
        storage = tensor.untyped_storage()._cdata
        entry = [tensor, storage, stream, None]
        entries.append(entry)
        entry[3] = (sys.getrefcount(tensor), _use_count(storage))
        return tensor


class _KeptForHook:
    """The tensors a hook's receive half uses, held from the send half until the hook has been launched.
    On the send's stream, stream order then protects them. On another stream they are recorded there,
    so that the allocator does not reuse their memory on the send's stream before that kernel has run.
    Memory the caller allocated on another stream stays the caller's to keep until it has waited for the
    call, as DeepEP leaves it (FusedMoE holds its single-batch-overlap signals so)."""

    def __init__(self, send_stream: int, *tensors: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
        self._send_stream = send_stream
        self._tensors = [t for item in tensors for t in (item if isinstance(item, tuple) else (item,))
                         if t is not None]

    def release(self, hook_stream: int) -> None:
        if hook_stream != self._send_stream:
            for t in self._tensors:
                t.record_stream(torch.cuda.current_stream(t.device))
        self._tensors.clear()


CUDA_TRANSPORTS = ("ipc", "nvshmem")  # create_backend resolves the Buffer's "auto" to one of them


class CudaBackend(Backend):
    name = "cuda"
    supports_rows_in_place = True
    signals_waited_on_device = True

    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                 num_rdma_bytes: int, timeout_s: float, *, shrink: bool = False,
                 peer_bases: list[int] | None = None, gpu_share: int = 1, num_nvl_bytes: int = 0,
                 nvl_peer_bases: list[int] | None = None, transport: str = "ipc") -> None:
        """`peer_bases` (buffers from `alloc_buffer`, one per rank) is for ranks emulated in one process,
        `gpu_share` how many of them run their kernels at the same time; without them the buffer is
        allocated here, the peers' are mapped through CUDA IPC, and the ranks on this GPU share it.
        `num_nvl_bytes` > 0 adds normal mode, over a second buffer of that size (cuda_normal.py; emulated
        ranks pass theirs as `nvl_peer_bases`); then `num_rdma_bytes` may be 0 (no low-latency calls: the
        low-latency buffer is only its control block). `transport`: how the ranks' buffers are shared,
        "ipc" (CUDA IPC) or "nvshmem" (NVSHMEM's symmetric heap, nvshmem_heap.py)."""
        super().__init__(group, rank, num_ranks, num_rdma_bytes, timeout_s, shrink)
        self._c = native.load_nvshmem() if transport == "nvshmem" else native.load()
        expect(num_ranks <= layout.MAX_RANKS, "group", f"at most {layout.MAX_RANKS} ranks for the cuda backend",
               num_ranks)
        expect(num_rdma_bytes > layout.CONTROL_BYTES or (num_rdma_bytes == 0 and num_nvl_bytes > 0),
               "num_rdma_bytes", "at least Buffer.get_low_latency_rdma_size_hint(T, H, num_ranks, E) bytes for the "
               "cuda backend (or 0 with num_nvl_bytes > 0: normal mode only)", num_rdma_bytes)
        expect((nvl_peer_bases is None) == (peer_bases is None or num_nvl_bytes == 0), "nvl_peer_bases",
               "one normal-mode buffer per rank exactly when emulated ranks (peer_bases) have num_nvl_bytes > 0",
               nvl_peer_bases)
        self.num_nvl_bytes = num_nvl_bytes
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._num_sms = self._c.num_sms()
        expect(transport in CUDA_TRANSPORTS, "transport", f"one of {CUDA_TRANSPORTS}", transport)
        expect(transport == "ipc" or peer_bases is None, "transport", "'ipc' for ranks emulated in one process",
               transport)
        self._transport = transport
        self._opened: list[int] = []  # peers' buffers mapped through IPC, closed on destroy
        self._symmetric: list[nvshmem_heap.SymmetricBuffer] = []  # NVSHMEM's, freed on destroy
        self._system_scope = False  # True once a peer sits on another GPU
        # Ranks reached through NVSHMEM puts (bit r; nvshmem_heap.put_ranks, agreed both ways between ranks).
        self._put_ranks = 0
        # Ranks whose kernels run on this GPU at the same time: each sizes its dispatch grids for its share
        # of the SMs, so that all of them run in one wave (8 emulated ranks side by side at T = 128 on an
        # H200: send blocks of four tokens instead of four waves of one-token blocks); a rank alone on the
        # GPU keeps all of it.
        self._gpu_share = gpu_share
        self._ranks_here = num_ranks if peer_bases is not None else 1  # on this GPU (learnt from the peers)
        ll_bytes = layout.allocated_low_latency_bytes(num_rdma_bytes)
        if transport == "nvshmem":
            nvl_bytes = num_nvl_bytes and layout.normal_landing_offset(num_nvl_bytes) + layout.NORMAL_LANDING_BYTES
            nvshmem_heap.join(group, rank, num_ranks, self._device, ll_bytes + nvl_bytes, self._c)
        if peer_bases is None:
            peer_bases = self._shared_buffer(ll_bytes, "num_rdma_bytes")
        self._base = peer_bases[rank]  # this rank's own buffer, freed on destroy
        self._peer_bases = list(peer_bases)
        self._host_flag, self._device_flag = self._c.alloc_host_flag()
        self._commons: dict[tuple[int, int, int, int], object] = {}
        self._output_sets: dict[tuple, list[_OutputSet]] = {}
        self._combine_views: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._combine_outputs: dict[tuple[int, int], _CombineOutputs] = {}
        self._buffer_start = device_tensor(self._base, (16,), self._device, torch.uint8)  # RowsInPlace.base
        expect(len(latency.BOUNDS_NS) <= self._c.MAX_LATENCY_BOUNDS, "latency.BOUNDS_NS",
               f"at most {self._c.MAX_LATENCY_BOUNDS} bounds (the kernels' __constant__ table)",
               len(latency.BOUNDS_NS))
        _set_latency_bounds(self._c, self._device)
        # Per Op: calls per bucket, then their sum in ns; the send kernels add the calls two before them.
        self._latency = torch.zeros(len(latency.OPS), latency.NUM_BUCKETS + 1, dtype=torch.int64,
                                    device=self._device)
        # Rank masking: 1 per masked rank, read by the kernels on every use; none when masking is off.
        with torch.inference_mode(False):
            self._mask = torch.zeros(num_ranks, dtype=torch.int32, device=self._device) if shrink else None
        self._normal: CudaNormalMode | None = None
        if num_nvl_bytes > 0:
            # On NVSHMEM the normal-mode buffer is followed by its landing area, for the ranks it reads with gets.
            landing = layout.NORMAL_LANDING_BYTES if transport == "nvshmem" else 0
            nvl_bases = nvl_peer_bases or self._shared_buffer(layout.normal_landing_offset(num_nvl_bytes) + landing
                                                              if landing else num_nvl_bytes, "num_nvl_bytes")
            self._nvl_base = nvl_bases[rank]
            self._normal = CudaNormalMode(self._c, rank, num_ranks, nvl_bases, num_nvl_bytes, self._system_scope,
                                          timeout_s, self._device, emulated=nvl_peer_bases is not None,
                                          max_sms=max(1, self._num_sms // self._gpu_share), get_ranks=self._put_ranks,
                                          landing=self._nvl_base + layout.normal_landing_offset(num_nvl_bytes)
                                          if landing else 0)

    def _shared_buffer(self, num_bytes: int, name: str) -> list[int]:
        """A zeroed buffer of `num_bytes` on every rank (a collective), and each rank's address here: ours
        shared through CUDA IPC (the peers' mapped, closed on destroy), or NVSHMEM's symmetric heap."""
        if self._transport == "ipc":
            base = self._c.alloc_buffer(num_bytes)
            if self.num_ranks == 1:
                return [base]
            handles = self._gather_peers(num_bytes, name, self._c.ipc_handle(base))
            bases = [base if r == self.rank else self._c.ipc_open(h) for r, h in enumerate(handles)]
            self._opened += [b for r, b in enumerate(bases) if r != self.rank]
            return bases
        symmetric = nvshmem_heap.allocate(num_bytes, self.rank, self._c)
        self._symmetric.append(symmetric)
        own = symmetric.bases[self.rank]
        self._c.memset_async(own, num_bytes, self._stream())
        torch.cuda.synchronize(self._device)
        puts = nvshmem_heap.put_ranks(symmetric)
        if self.num_ranks > 1:  # also: every rank's buffer is zeroed before any call
            theirs = self._gather_peers(num_bytes, name, puts)
            puts |= sum(1 << r for r, their_puts in enumerate(theirs) if their_puts >> self.rank & 1)
        self._put_ranks |= puts
        # A put rank is addressed at this rank's own buffer: its symmetric address, which NVSHMEM resolves.
        return [own if puts >> r & 1 else base for r, base in enumerate(symmetric.bases)]

    def _gather_peers(self, num_bytes: int, name: str, handle: object) -> list:
        """Every rank's `handle` through the group, checking that `num_bytes` agree; learns which peers
        share this GPU (`gpu_share`) and whether one sits on another GPU (system-scope ordering)."""
        device_id = str(torch.cuda.get_device_properties(self._device).uuid)
        gathered: list = [None] * self.num_ranks
        dist.all_gather_object(gathered, (handle, num_bytes, device_id), group=self.group)
        sizes = {r: g[1] for r, g in enumerate(gathered)}
        expect(len(set(sizes.values())) == 1, name, "the same on every rank", sizes)
        self._system_scope = len({g[2] for g in gathered}) > 1
        self._gpu_share = self._ranks_here = sum(g[2] == device_id for g in gathered)
        return [g[0] for g in gathered]

    @property
    def ranks_on_this_gpu(self) -> int:
        return self._ranks_here

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ errors
    def _raise_recorded(self) -> None:
        """Raise what a kernel recorded; the host-mapped flag makes the no-error case free."""
        record = take_recorded_error(self._c, self._base, self._host_flag)
        if record is None:
            return
        code, op, mask, detail = record
        what = _OPS[op]
        if code == _TIMEOUT:
            raise EPTimeoutError(what, _ranks(mask), self.timeout_s, self.rank)
        if code == _MISMATCH:
            raise ValueError(f"{what}: rank(s) {_ranks(mask)} called with a different "
                             "num_max_dispatch_tokens_per_rank, hidden, num_experts or FP8 flags than "
                             f"rank {self.rank}")
        if code == _BAD_EXPERT:
            raise ValueError(f"topk_idx: expected expert ids in [-1, num_experts), got {detail} "
                             "(that entry was treated as -1)")
        if code == _SIGNAL_TIMEOUT:
            raise overlap_signal_timeout(self.rank, [detail], self.timeout_s)

    def check(self) -> None:
        torch.cuda.current_stream().synchronize()
        self._raise_recorded()
        if self._normal is not None:
            self._normal.raise_recorded()

    # ------------------------------------------------------------------ normal mode
    def normal_dispatch(self, args: NormalDispatchArgs) -> NormalDispatchResult:
        return self._normal_mode("dispatch").dispatch(args)

    def normal_combine(self, args: NormalCombineArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._normal_mode("combine").combine(args)

    def normal_combine_buffer(self, rows: int, hidden: int, device: torch.device) -> torch.Tensor:
        return self._normal_mode("get_next_combine_buffer").combine_buffer(rows, hidden)

    def _normal_mode(self, op: str) -> CudaNormalMode:
        if self._normal is None:
            raise RuntimeError(f"{op}: this cuda backend was made without a normal-mode buffer (num_nvl_bytes=0)")
        return self._normal

    def latency_stats(self) -> dict[str, LatencyHistogram]:
        torch.cuda.synchronize(self._device)  # every stream: a hook or async_finish may have run elsewhere
        # The device histogram holds every completed call but the last one or two per op, whose records
        # wait for the next sends on their halves: add those here, leaving the device state as it is.
        rows = self._latency.tolist()
        for row, pending in zip(rows, _unaccounted_rows(self._c.read_timing(self._base))):
            row[:] = [a + b for a, b in zip(row, pending)]
        return {op: LatencyHistogram.from_ns(row[:-1], row[-1]) for op, row in zip(latency.OPS, rows)}

    # ------------------------------------------------------------------ per-shape state
    def _common(self, max_tokens: int, hidden: int, num_experts: int, flags: int) -> object:
        key = (max_tokens, hidden, num_experts, flags)
        common = self._commons.get(key)
        if common is None:
            expect(hidden % FP8_GROUP == 0 and hidden <= MAX_HIDDEN, "x", f"a hidden size that is a multiple "
                   f"of {FP8_GROUP} and at most {MAX_HIDDEN} for the cuda backend", hidden)
            expect(num_experts <= layout.MAX_EXPERTS, "num_experts", f"at most {layout.MAX_EXPERTS}", num_experts)
            need = layout.low_latency_buffer_bytes(max_tokens, hidden, self.num_ranks, num_experts)
            expect(need <= self.num_rdma_bytes, "num_rdma_bytes", f"at least {need} for T={max_tokens}, "
                   f"H={hidden} (Buffer.get_low_latency_rdma_size_hint)", self.num_rdma_bytes)
            offsets = self._c.BufferOffsets(**layout.buffer_offsets(max_tokens, hidden, self.num_ranks)._asdict())
            common = self._c.make_common(self._c.CommonArgs(
                rank=self.rank, num_ranks=self.num_ranks, max_tokens=max_tokens, hidden=hidden,
                num_experts=num_experts, spec_check=zlib.crc32(repr(key).encode()), system_scope=self._system_scope,
                gpu_share=self._gpu_share, peer_bases=self._peer_bases, local_base=self._base, layout=offsets,
                host_error=self._device_flag, timeout_s=self.timeout_s, latency=self._latency.data_ptr(),
                mask=_data_ptr(self._mask), put_ranks=self._put_ranks))
            self._commons[key] = common
        return common

    def _stream(self) -> int:
        """The current CUDA stream as a raw pointer, without the Stream object that
        torch.cuda.current_stream() builds on every call (host time on every eager call)."""
        return torch._C._cuda_getCurrentRawStream(self._device.index)

    def _chunks_per_slot(self, slots: int) -> int:
        """Split each received token into channel chunks until there are ~16 warps of work per SM."""
        return max(1, min(8, math.ceil(16 * (self._num_sms // self._gpu_share) / slots)))

    def _blocks_per_expert(self, num_local: int) -> int:
        # About one block per SM in total: fewer blocks leave the copies latency-bound, more re-read every
        # slot header once per extra block.
        return max(1, min(16, math.ceil(self._num_sms / num_local)))

    # ------------------------------------------------------------------ dispatch
    def _outputs(self, spec: DispatchSpec, rows_in_place: bool, stream: int) -> _OutputSet:
        """A free output set of this shape (_OutputSet), or a new one (the few used last are kept)."""
        pool = self._output_sets.get((spec, rows_in_place))
        if pool is None:
            pool = self._output_sets[spec, rows_in_place] = []
        for i, out in enumerate(pool):
            if out.free_on(stream):
                if i + 1 < len(pool):
                    pool.append(pool.pop(i))  # most recently used last
                out.join_uses()
                return out
        pool[:] = [out for out in pool if out.stream != _OutputSet.RETIRED]
        out = self._new_outputs(spec, rows_in_place, stream)
        out.settle()  # here nothing but the set refers to its parts
        if len(pool) == _MAX_OUTPUT_SETS:  # the least recently used goes (its tensors live on while held)
            pool.pop(0)
        pool.append(out)
        return out

    def _new_outputs(self, spec: DispatchSpec, rows_in_place: bool, stream: int) -> _OutputSet:
        num_local, rows, dev = spec.num_experts // self.num_ranks, self.num_ranks * spec.max_tokens, self._device
        with torch.inference_mode(False):  # recycled across calls: usable in and out of inference mode
            ints = torch.empty(2 + num_local * (1 + 2 * rows), dtype=torch.int32, device=dev)
            recv_count = ints.as_strided((num_local,), (1,), 2)
            src_info = ints.as_strided((num_local, rows), (rows, 1), 2 + num_local)
            layout_range = torch.empty((num_local, self.num_ranks), dtype=torch.int64, device=dev)
            owned = [ints, layout_range]
            scales = None
            if spec.use_fp8:  # column-major, as DeepEP's
                groups = spec.hidden // (FP8_GROUP * UE8M0_PACK) if spec.use_ue8m0 else spec.hidden // FP8_GROUP
                scales = torch.empty_strided((num_local, rows, groups), (groups * rows, 1, rows), device=dev,
                                             dtype=torch.int32 if spec.use_ue8m0 else torch.float32)
                owned.append(scales)
            recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | RowsInPlace
            if rows_in_place:  # the receive half names each row's data and packs the scales
                offsets = torch.empty((num_local, rows), dtype=torch.int64, device=dev)
                recv_x = RowsInPlace(self._buffer_start, offsets, scales, spec.hidden)
                data_ptr, rows_ptr = 0, offsets.data_ptr()
                owned.append(offsets)
            else:
                data = torch.empty((num_local, rows, spec.hidden), device=dev,
                                   dtype=torch.float8_e4m3fn if spec.use_fp8 else torch.bfloat16)
                recv_x = (data, scales) if scales is not None else data
                data_ptr, rows_ptr = data.data_ptr(), 0
                owned.append(data)
        base = ints.data_ptr()
        pointers = DispatchPointers(ticket=base, recv_x=data_ptr, recv_scales=_data_ptr(scales), recv_rows=rows_ptr,
                                    recv_count=base + 8, src_info=base + 4 * (2 + num_local),
                                    layout_range=layout_range.data_ptr(),
                                    combine_map=base + 4 * (2 + num_local + num_local * rows))
        return _OutputSet(recv_x, recv_count, src_info, layout_range, ints, pointers, owned, stream, dev.index)

    def _prepare_dispatch(self, out: _OutputSet, spec: DispatchSpec, num_tokens: int, num_topk: int,
                          rows_in_place: bool) -> object:
        """The set's _C.PreparedDispatch for this many tokens and top-k entries, made on first use."""
        t, h, e = spec.max_tokens, spec.hidden, spec.num_experts
        flags = int(spec.use_fp8) | int(spec.round_scale) << 1 | int(spec.use_ue8m0) << 2
        shape = self._c.DispatchShape(num_tokens=num_tokens, num_topk=num_topk, use_fp8=spec.use_fp8,
                                      round_scale=spec.round_scale, use_ue8m0=spec.use_ue8m0,
                                      chunks_per_slot=1 if rows_in_place else self._chunks_per_slot(self.num_ranks * t))
        prepared = out.dispatches[num_tokens, num_topk] = self._c.prepare_dispatch(self._common(t, h, e, flags), shape,
                                                                                  out.pointers)
        return prepared

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, spec: DispatchSpec,
                 recv_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, *,
                 hook: bool, rows_in_place: bool = False) -> DispatchResult:
        if self._c.read_host_flag(self._host_flag):
            self._raise_recorded()
        x, topk_idx = x.contiguous(), topk_idx.contiguous()
        stream = self._stream()
        out = self._outputs(spec, rows_in_place, stream)
        num_tokens, num_topk = x.shape[0], topk_idx.shape[1]
        prepared = out.dispatches.get((num_tokens, num_topk))
        if prepared is None:
            prepared = self._prepare_dispatch(out, spec, num_tokens, num_topk, rows_in_place)
        args = (prepared, x.data_ptr(), topk_idx.data_ptr(), 0 if recv_stats is None else recv_stats.data_ptr(),
                0 if wait_stats is None else wait_stats.data_ptr())
        handle: Handle = (out.src_info, out.layout_range, spec.max_tokens, spec.hidden, spec.num_experts)
        if not hook:  # one kernel does both halves
            self._c.dispatch_both_halves(*args, stream)
            # DispatchResult(...) without its constructor's Python frame (0.2 µs a call, by the host probe)
            return tuple.__new__(DispatchResult, (out.recv_x, out.recv_count, handle, _nothing, out))
        self._c.dispatch_send(*args, stream)
        # The receive half writes the outputs and updates the caller's stats tensors: until it has been
        # launched the set is not recycled and the stats stay alive, even if the caller drops them.
        keep = _KeptForHook(stream, recv_stats, wait_stats)
        out.pending += 1

        def receive() -> None:
            hook_stream = self._stream()
            self._c.dispatch_receive(*args, hook_stream)
            keep.release(hook_stream)
            out.pending -= 1
            out.used_on(hook_stream)

        return DispatchResult(out.recv_x, out.recv_count, handle, receive, out)

    # ------------------------------------------------------------------ combine
    def _prepare_combine(self, outputs: _OutputSet, handle: Handle, num_tokens: int, num_topk: int) -> object:
        """The dispatch set's _C.PreparedCombine for this many tokens and top-k entries, made on first use."""
        _, _, t, h, e = handle
        shape = self._c.CombineShape(num_tokens=num_tokens, num_topk=num_topk,
                                     blocks_per_expert=self._blocks_per_expert(e // self.num_ranks))
        pointers = CombinePointers(ticket=outputs.pointers.ticket + 4, recv_count=outputs.pointers.recv_count,
                                   combine_map=outputs.pointers.combine_map)
        prepared = outputs.combines[num_tokens, num_topk] = self._c.prepare_combine(self._common(t, h, e, 0), shape,
                                                                                   pointers)
        return prepared

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: Handle, private: object, out: torch.Tensor,
                wait_stats: torch.Tensor | None, *, hook: bool, slot: int, signals: SendSignals | None = None,
                send_sms: int | None = None) -> ReceiveHalf:
        if self._c.read_host_flag(self._host_flag):
            self._raise_recorded()
        outputs: _OutputSet = private  # type: ignore[assignment]
        x, topk_idx, topk_weights = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
        num_tokens, num_topk = topk_idx.shape
        prepared = outputs.combines.get((num_tokens, num_topk))
        if prepared is None:
            prepared = self._prepare_combine(outputs, handle, num_tokens, num_topk)
        overlap = None if signals is None and send_sms is None else _overlap(self._c, signals, send_sms)
        x_ptr = x.data_ptr()
        args = (prepared, x_ptr, self._row_in_buffer(x_ptr, handle),
                self._stage_row(x_ptr, slot, handle) if self._put_ranks else -1, topk_idx.data_ptr(),
                topk_weights.data_ptr(), out.data_ptr(), 0 if wait_stats is None else wait_stats.data_ptr(), overlap)
        stream = self._stream()
        # One kernel does both halves, unless its senders wait for the GEMM or are held to a few SMs: then its
        # reducers could hold the SMs the GEMM needs (csrc/ll_combine.cu, combine_fused).
        if not hook and overlap is None:
            self._c.combine_both_halves(*args, stream)
            outputs.used_on(stream)  # it reads recv_count and combine_map
            return _nothing
        self._c.combine_send(*args, stream)
        outputs.used_on(stream)  # the send reads recv_count and combine_map
        # What the receive half reads (x: its own rows in place) and writes (out, even if the caller has
        # dropped it), alive until it has been launched.
        keep = _KeptForHook(stream, x, topk_idx, topk_weights, out, wait_stats,
                            signals.signals if signals is not None else None)
        outputs.pending += 1  # its receive reads the ticket in the dispatch's set

        def receive() -> None:
            hook_stream = self._stream()
            self._c.combine_receive(*args, hook_stream)
            keep.release(hook_stream)
            outputs.pending -= 1
            outputs.used_on(hook_stream)

        return receive

    def combine_output(self, num_tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
        if torch._C._cuda_isCurrentStreamCapturing():  # the graph's own pool: its replays write there
            return super().combine_output(num_tokens, hidden, device)
        outputs = self._combine_outputs.get((num_tokens, hidden))
        if outputs is None:
            outputs = self._combine_outputs[num_tokens, hidden] = _CombineOutputs(
                lambda: torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self._device))
        return outputs.take(self._stream())

    def combine_buffer(self, slot: int, handle: Handle) -> torch.Tensor:
        """A view of zero-copy combine buffer `slot` in this rank's communication buffer (ep_layer.layout)."""
        _, _, t, h, e = handle
        key = (slot, t, h, e)
        view = self._combine_views.get(key)
        if view is None:
            self._common(t, h, e, 0)  # checks the sizes and that the buffer holds them
            start = layout.zero_copy_offset(t, h, self.num_ranks) + slot * layout.zero_copy_bytes(t, h, e)
            shape = (e // self.num_ranks, self.num_ranks * t, h)
            view = self._combine_views[key] = device_tensor(self._base + start, shape, self._device)
        return view

    def _buffer_row(self, x_ptr: int, handle: Handle) -> int | None:
        """Combine's x (bf16 [E_l, R*T, H] at x_ptr) as a row of this rank's buffer (2H bytes a row), or None when
        it lies elsewhere."""
        _, _, t, h, e = handle
        offset, row_bytes = x_ptr - self._base, 2 * h
        inside = offset >= 0 and offset + e * t * row_bytes <= self.num_rdma_bytes and offset % row_bytes == 0
        return offset // row_bytes if inside else None

    def _row_in_buffer(self, x_ptr: int, handle: Handle) -> int:
        """Combine's x's first row in this rank's buffer when peers sharing this GPU can read it there (a zero-copy
        combine), else -1: the send half then copies the rows into the peers' slots."""
        row = None if self._system_scope else self._buffer_row(x_ptr, handle)
        return -1 if row is None else row

    def _stage_row(self, x_ptr: int, slot: int, handle: Handle) -> int:
        """The row of this rank's buffer that the rows for put ranks are put from (a put's source lies on the
        symmetric heap): x's own when it lies in the buffer, else zero-copy buffer `slot`'s, which the kernel
        copies them into (it belongs to this dispatch, so no other call writes there meanwhile)."""
        row = self._buffer_row(x_ptr, handle)
        if row is not None:
            return row
        return (self.combine_buffer(slot, handle).data_ptr() - self._base) // (2 * handle[3])

    # ------------------------------------------------------------------ housekeeping
    def _barrier(self) -> None:
        """Every rank's kernels on these buffers are done. Once a rank is masked only this rank's are
        waited for: a dead rank never joins a barrier of the group."""
        torch.cuda.synchronize(self._device)
        someone_masked = self._mask is not None and bool(self._mask.any())
        if self.num_ranks > 1 and self.group is not None and not someone_masked:
            dist.barrier(group=self.group)

    def clean(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        self._barrier()
        # The memset clears the timing records: move their calls into the histogram first.
        pending = _unaccounted_rows(self._c.read_timing(self._base))
        if any(any(row) for row in pending):
            self._latency += torch.tensor(pending, dtype=torch.int64).to(self._device)
        self._c.memset_async(self._base, self.num_rdma_bytes, self._stream())
        self._c.clear_host_flag(self._host_flag)
        self._barrier()

    # ------------------------------------------------------------------ rank masking (on the current stream)
    def query_mask(self, out: torch.Tensor) -> None:
        out.copy_(self._mask)

    def update_mask(self, rank: int, masked: bool) -> None:
        self._mask[rank].fill_(int(masked))

    def clean_mask(self) -> None:
        self._mask.zero_()

    def local_buffer(self, offset: int) -> torch.Tensor:
        return device_tensor(self._base + offset, (self.num_rdma_bytes - offset,), self._device, torch.uint8)

    def destroy(self) -> None:
        self._barrier()
        for p in self._opened:
            self._c.ipc_close(p)
        self._opened.clear()
        self._combine_views.clear()
        self._output_sets.clear()
        self._combine_outputs.clear()
        self._c.free_host_flag(self._host_flag)
        if self._normal is not None:
            self._normal.destroy()
        if self._transport == "nvshmem":
            # Freeing is collective over every PE: with a rank masked (dead) it would never return, so the
            # symmetric buffers stay allocated until the job ends.
            if not (self._mask is not None and bool(self._mask.any())):
                for symmetric in self._symmetric:
                    nvshmem_heap.free(symmetric)
            self._symmetric.clear()
            return
        self._c.free_buffer(self._base)
        if self._normal is not None:
            self._c.free_buffer(self._nvl_base)
