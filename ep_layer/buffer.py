"""`Buffer`: DeepEP's low-latency API (dispatch / combine / hooks) in front of a pluggable backend.

The class validates every argument, then forwards to the backend (`reference` or `cuda`); it owns what
is the same for all backends: hooks, `async_finish` events, and per-dispatch state such as the
zero-copy combine buffer.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from .backends import Backend, DispatchResult, DispatchSpec, Handle, create_backend
from .backends.exchange import group_rank_and_size
from .checks import (
    MAX_TOKENS_PER_RANK,
    check_experts,
    check_fp8_options,
    check_positive_int,
    check_tensor,
    check_topk,
    expect,
)
from .event import EventOverlap
from .latency import LatencyHistogram
from .layout import low_latency_buffer_bytes

DEFAULT_TIMEOUT_S = 100.0
_OUTSTANDING = 2  # results that may be pending at once (double buffering, as in DeepEP)

Hook = Callable[[], None]
Result = TypeVar("Result")


def _once(receive: Hook, op: str) -> Hook:
    """The hook handed to the caller: the receive half, which may run only once (a second run would
    receive again and count the expert-load and wait stats twice)."""
    done = False

    def hook() -> None:
        nonlocal done
        if done:
            raise RuntimeError(f"{op}: this hook has already run (each call's receive half runs once)")
        done = True
        receive()

    return hook


class _DispatchRecord:
    """What the Buffer remembers about one dispatch, found again from its handle in combine."""

    def __init__(self, handle: Handle, slot: int, private: object) -> None:
        self.src_info = weakref.ref(handle[0])
        self.layout_range = weakref.ref(handle[1])
        self.sizes = handle[2:]  # (T, H, E)
        self.slot = slot  # which zero-copy combine buffer belongs to this dispatch
        self.private = private  # backend state that combine needs (e.g. row -> source slot map)

    def matches(self, handle: tuple) -> bool:
        """`handle` is the one this dispatch returned, unaltered."""
        return (self.src_info() is handle[0] and self.layout_range() is handle[1]
                and all(a is b or (type(a) is int and a == b) for a, b in zip(handle[2:], self.sizes)))


class Buffer:
    """Expert-parallel communication buffer with DeepEP's low-latency interface.

    `group` is the EP process group (None = a single rank). DeepEP's tuning arguments are accepted
    and ignored. `backend` is "auto" (our CUDA kernels where built and a GPU is present), "cuda" or
    "reference"; `timeout_s` bounds every wait for a peer rank.
    """

    num_sms = 0

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        expect(low_latency_mode, "low_latency_mode", "True (only DeepEP's low-latency mode is supported)",
               low_latency_mode)
        expect(type(num_rdma_bytes) is int and num_rdma_bytes >= 0, "num_rdma_bytes", "a non-negative int",
               num_rdma_bytes)
        expect(type(timeout_s) in (int, float) and 0 < timeout_s < math.inf, "timeout_s",
               "a positive, finite number of seconds", timeout_s)
        rank, size = group_rank_and_size(group)
        self._attach(create_backend(backend, group, rank, size, num_rdma_bytes, float(timeout_s)))
        self.num_nvl_bytes = num_nvl_bytes
        self.explicitly_destroy = explicitly_destroy

    @classmethod
    def from_backend(cls, backend: Backend) -> Buffer:
        """A Buffer around an existing backend (e.g. one of several ranks emulated in one process)."""
        expect(isinstance(backend, Backend), "backend", "an ep_layer.backends.Backend", type(backend).__name__)
        buffer = cls.__new__(cls)
        buffer._attach(backend)
        buffer.num_nvl_bytes = 0
        buffer.explicitly_destroy = False
        return buffer

    def _attach(self, backend: Backend) -> None:
        self.group = backend.group
        self.rank, self.group_size = backend.rank, backend.num_ranks
        self.num_rdma_bytes = backend.num_rdma_bytes
        self.low_latency_mode = True
        self.timeout_s = backend.timeout_s
        self._backend: Backend | None = backend
        self.backend_name = backend.name
        self._dispatches: OrderedDict[int, _DispatchRecord] = OrderedDict()
        self._num_dispatches = 0
        self._combine_buffers: dict[int, torch.Tensor] = {}
        self._comm_stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ sizing and housekeeping
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of communication buffer the `cuda` backend needs for these sizes."""
        t = check_positive_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank",
                               MAX_TOKENS_PER_RANK)
        h = check_positive_int(hidden, "hidden")
        r = check_positive_int(num_ranks, "num_ranks")
        check_experts(num_experts, r)
        return low_latency_buffer_bytes(t, h, r, num_experts)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM budget for its normal kernels; the low-latency kernels size themselves."""
        Buffer.num_sms = check_positive_int(new_num_sms, "new_num_sms")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Forget outstanding dispatches and reset the backend's communication state."""
        backend = self._live()
        check_positive_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", MAX_TOKENS_PER_RANK)
        check_positive_int(hidden, "hidden")
        check_experts(num_experts, self.group_size)
        self._dispatches.clear()
        self._combine_buffers.clear()
        backend.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def check(self) -> None:
        """Raise any error the device recorded (e.g. `EPTimeoutError`) since the last check."""
        self._live().check()

    def latency_stats(self) -> dict[str, LatencyHistogram]:
        """Histograms of the latency of every "dispatch" and "combine" call since this Buffer was made
        (an ep_layer extension, like `check()`). One call's latency is the time it occupies the stream:
        its send half plus its receive half, waits for peers included; with `return_recv_hook=True` the
        work between the send and the hook is not counted. The cuda backend measures it on the device
        (recording never synchronizes; reading here does: call it at scrape time, not per step); the
        reference backend measures host time."""
        return self._live().latency_stats()

    def destroy(self) -> None:
        """Free the buffer's memory and peer mappings; the Buffer cannot be used afterwards."""
        if self._backend is not None:
            self._backend.destroy()
        self._backend = None
        self._dispatches.clear()
        self._combine_buffers.clear()

    def _live(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("Buffer: used after destroy()")
        return self._backend

    def _device(self, x: torch.Tensor) -> torch.device:
        return self._live().device or x.device

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             rows_in_place: bool = False):
        """Send each token to the ranks of its experts; returns (recv_x, recv_count, handle, event, hook).

        rows_in_place (ours, not DeepEP's; see `supports_rows_in_place`): recv_x is a `RowsInPlace` that
        names where each received row lies in the communication buffer, instead of a packed copy of the
        rows (one pass over HBM fewer, for GEMMs that read rows where they lie: ep_layer.moe's Triton
        kernels). Float32 scales only (not with use_ue8m0)."""
        backend = self._live()
        expect(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__)
        device = self._device(x)
        x = check_tensor(x, "x", torch.bfloat16, (None, None), device)
        num_tokens, hidden = x.shape
        t = check_positive_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank",
                               MAX_TOKENS_PER_RANK)
        e = check_experts(num_experts, self.group_size)
        check_topk(topk_idx, num_tokens, t, device)
        check_fp8_options(hidden, use_fp8, round_scale, use_ue8m0)
        num_local = e // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats",
                         torch.int32, (num_local,), device)
        if dispatch_wait_recv_cost_stats is not None:
            check_tensor(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", torch.int64,
                         (self.group_size,), device)
        self._check_modes(async_finish, return_recv_hook)
        if rows_in_place:
            expect(backend.supports_rows_in_place, "rows_in_place", f"False for the {backend.name} backend "
                   "(only the cuda backend leaves rows in place)", rows_in_place)
            expect(not use_ue8m0, "rows_in_place", "False with use_ue8m0 (rows in place keep float32 scales)",
                   rows_in_place)
        spec = DispatchSpec(t, hidden, e, bool(use_fp8), bool(round_scale), bool(use_ue8m0))

        def send() -> tuple[DispatchResult, Hook]:
            result = backend.dispatch(x, topk_idx, spec, cumulative_local_expert_recv_stats,
                                      dispatch_wait_recv_cost_stats, hook=return_recv_hook,
                                      rows_in_place=bool(rows_in_place))
            self._remember(result.handle, result.private)
            return result, result.receive

        result, event, hook = self._run(send, async_finish, return_recv_hook, (x, topk_idx), "low_latency_dispatch")
        return result.recv_x, result.recv_count, result.handle, event, hook

    # ------------------------------------------------------------------ combine
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Weighted sum of each token's expert outputs back on its rank; returns (combined_x, event, hook)."""
        backend = self._live()
        expect(not use_logfmt, "use_logfmt", "False (LogFMT combine is not supported)", use_logfmt)
        record = self._record(handle)
        _, _, t, hidden, e = handle
        num_local, rows = e // self.group_size, self.group_size * t
        expect(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__)
        device = self._device(x)
        check_tensor(x, "x", torch.bfloat16, (num_local, rows, hidden), device)
        expect(isinstance(topk_idx, torch.Tensor), "topk_idx", "a torch.Tensor", type(topk_idx).__name__)
        num_tokens, k = check_topk(topk_idx, topk_idx.shape[0], t, device, "topk_idx").shape
        check_tensor(topk_weights, "topk_weights", torch.float32, (num_tokens, k), device)
        if out is None:
            out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        else:
            check_tensor(out, "out", torch.bfloat16, (num_tokens, hidden), device)
        if combine_wait_recv_cost_stats is not None:
            check_tensor(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", torch.int64,
                         (self.group_size,), device)
        self._check_modes(async_finish, return_recv_hook)
        if zero_copy:
            x = self._combine_buffer(record, handle, device)
        combined = out

        def send() -> tuple[torch.Tensor, Hook]:
            return combined, backend.combine(x, topk_idx, topk_weights, handle, record.private, combined,
                                             combine_wait_recv_cost_stats)

        _, event, hook = self._run(send, async_finish, return_recv_hook, (x, topk_idx, topk_weights),
                                   "low_latency_combine")
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """The bf16 [E_l, R*T, H] buffer that `low_latency_combine(..., zero_copy=True)` reads for `handle`."""
        self._live()
        record = self._record(handle)
        return self._combine_buffer(record, handle, handle[0].device)

    @property
    def supports_rows_in_place(self) -> bool:
        """Whether `low_latency_dispatch(..., rows_in_place=True)` works here (the cuda backend)."""
        return self._live().supports_rows_in_place

    # ------------------------------------------------------------------ shared plumbing
    @staticmethod
    def _check_modes(async_finish: bool, return_recv_hook: bool) -> None:
        expect(not (async_finish and return_recv_hook), "async_finish",
               "False when return_recv_hook=True (the two are exclusive)", async_finish)

    def _run(self, send: Callable[[], tuple[Result, Hook]], async_finish: bool, return_recv_hook: bool,
             inputs: tuple[torch.Tensor, ...], op: str) -> tuple[Result, EventOverlap | None, Hook | None]:
        """Run the send half, then the receive half now (plain), later (hook) or on a side stream."""
        if async_finish and inputs[0].is_cuda:
            stream = self._comm_stream = self._comm_stream or torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                result, receive = send()
                receive()
                event = torch.cuda.Event()
                event.record(stream)
            for t in inputs:
                t.record_stream(stream)
            return result, EventOverlap(event, inputs), None
        result, receive = send()
        if return_recv_hook:
            return result, None, _once(receive, op)
        receive()
        return result, (EventOverlap(None, inputs) if async_finish else None), None

    def _remember(self, handle: Handle, private: object) -> None:
        slot = self._num_dispatches % _OUTSTANDING
        self._num_dispatches += 1
        # A dead handle's id can come back: drop its stale entry so the new one is the newest.
        self._dispatches.pop(id(handle[0]), None)
        self._dispatches[id(handle[0])] = _DispatchRecord(handle, slot, private)
        while len(self._dispatches) > _OUTSTANDING:
            self._dispatches.popitem(last=False)

    def _record(self, handle: object) -> _DispatchRecord:
        ok = isinstance(handle, tuple) and len(handle) == 5 and isinstance(handle[0], torch.Tensor)
        expect(ok, "handle", "the handle returned by low_latency_dispatch", type(handle).__name__)
        assert isinstance(handle, tuple)
        record = self._dispatches.get(id(handle[0]))
        if record is None or not record.matches(handle):
            raise ValueError(f"handle: not from one of this Buffer's last {_OUTSTANDING} dispatches "
                             "(at most two results may be outstanding)")
        return record

    def _combine_buffer(self, record: _DispatchRecord, handle: Handle, device: torch.device) -> torch.Tensor:
        own = self._live().combine_buffer(record.slot, handle)
        if own is not None:
            return own
        _, _, t, hidden, e = handle
        shape = (e // self.group_size, self.group_size * t, hidden)
        buf = self._combine_buffers.get(record.slot)
        if buf is None or buf.shape != shape or buf.device != device:
            with torch.inference_mode(False):  # kept across calls: writable outside inference mode too
                buf = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self._combine_buffers[record.slot] = buf
        return buf
