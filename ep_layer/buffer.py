"""`Buffer`: DeepEP's low-latency API (dispatch / combine / hooks) in front of a pluggable backend.

The class validates every argument, then forwards to the backend (`reference` or `cuda`); it owns what
is the same for all backends: hooks, `async_finish` events, and per-dispatch state such as the
zero-copy combine buffer. It has every name of DeepEP's `Buffer` that vLLM and SGLang use, so that the
`deep_ep` drop-in (dropin/) is this class. DeepEP's normal (high-throughput) mode comes from the
NormalMode mixin (ep_layer/normal_mode.py).

Eager calls are on the host's critical path (every call of an engine that runs without CUDA graphs),
so a call validates its arguments once per combination of shapes, dtypes, devices and flags and
remembers the outcome, and runs with torch's function hooks off (a default-device mode, such as
`torch.set_default_device('cuda')`, otherwise intercepts every tensor operation of the call).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .backends import Backend, DispatchSpec, Handle, create_backend
from .backends.base import SendSignals
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
from .config import Config
from .event import EventOverlap
from .latency import LatencyHistogram
from .layout import low_latency_buffer_bytes
from .normal_mode import NormalMode

DEFAULT_TIMEOUT_S = 100.0
_OUTSTANDING = 2  # results that may be pending at once (double buffering, as in DeepEP)
_MAX_CACHED_CHECKS = 256  # argument combinations remembered per op (a serving engine uses a handful)

# Keyword arguments that only DeepEP forks know and ep-layer does not serve (NVFP4 dispatch): named in the error.
_FORK_ONLY = {"low_latency_dispatch": ("use_nvfp4", "x_global_scale"), "low_latency_combine": ()}

Hook = Callable[[], None]
_no_torch_function = torch._C.DisableTorchFunction  # our tensors always name their device


def _refuse_unknown(op: str, given: dict) -> None:
    fork = sorted(k for k in given if k in _FORK_ONLY[op])
    if fork:
        raise NotImplementedError(f"{op}: {', '.join(fork)} exist only in forks of DeepEP; ep-layer does not "
                                  "support them")
    raise TypeError(f"{op}() got unexpected keyword argument(s) {', '.join(sorted(given))}")


def _meta(t: torch.Tensor | None) -> tuple | None:
    """What the checks of an optional tensor argument depend on."""
    return None if t is None else (type(t), t.shape, t.dtype, t.device)


def _once(receive: Hook, op: str) -> Hook:
    """The hook handed to the caller: the receive half, which may run only once (a second run would
    receive again and count the expert-load and wait stats twice)."""
    done = False

    def hook() -> None:
        nonlocal done
        if done:
            raise RuntimeError(f"{op}: this hook has already run (each call's receive half runs once)")
        done = True
        with _no_torch_function():
            receive()

    return hook


class _CombineCheck(NamedTuple):
    """What combine's argument checks established for one combination of arguments."""

    device: torch.device
    num_local: int


class _DispatchRecord(NamedTuple):
    """What the Buffer remembers about one dispatch, found again from its handle in combine, until the
    dispatch two calls later replaces it. It names the handle without holding it: its tensors are the
    caller's to keep or drop (a backend may recycle outputs nobody holds). Made on every dispatch, with
    `_DispatchRecord.of` (a tuple without the NamedTuple constructor's Python frame)."""

    handle_id: int  # id(handle): unique while the caller holds the tuple, which is when it can pass it
    src_info: weakref.ref  # to handle[0]
    slot: int  # which zero-copy combine buffer belongs to this dispatch
    private: object  # backend state that combine needs (e.g. the cuda backend's output set)
    recv_count_ptr: int  # the dispatch's recv_count (overlap's packed_recv_count)

    @staticmethod
    def of(handle: Handle, slot: int, private: object, recv_count: torch.Tensor) -> _DispatchRecord:
        return tuple.__new__(_DispatchRecord, (id(handle), weakref.ref(handle[0]), slot, private,
                                               recv_count.data_ptr()))


class Buffer(NormalMode):
    """Expert-parallel communication buffer with DeepEP's interface: the low-latency calls (a Buffer made
    with `low_latency_mode=True`) and the normal-mode ones (a Buffer made with `num_nvl_bytes` > 0; both
    at once, as SGLang's auto mode uses them, with both).

    `group` is the EP process group (None = a single rank). DeepEP's RDMA tuning arguments are accepted
    and ignored; `use_fabric=True` (fabric memory handles) is not supported. `enable_shrink` is DeepEP's rank
    masking (fault tolerance): a peer that misses a wait is masked instead of failing the call.
    `backend` is "auto" (our CUDA kernels where built and a GPU is present), "cuda" or "reference";
    `timeout_s` bounds every wait for a peer rank. `transport` is how the cuda backend shares the ranks'
    buffers: "ipc" (CUDA IPC, one node), "nvshmem" (NVSHMEM's symmetric heap, through nvshmem4py: `pip
    install 'ep-layer[nvshmem]'`; peers on other nodes reached by NVSHMEM puts), or "auto": NVSHMEM when
    the ranks span several hosts and `num_rdma_bytes` > 0, else CUDA IPC.
    """

    num_sms: int = 20  # DeepEP's SM budget of its normal-mode kernels; the low-latency kernels size themselves

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: object = None, *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport: str = "auto") -> None:
        if comm is not None:
            raise NotImplementedError("comm: an MPI communicator is not supported; pass the torch.distributed "
                                      "group of the EP ranks as `group`")
        if use_fabric:
            raise NotImplementedError("use_fabric=True: buffers on fabric memory handles (multi-node NVLink) are "
                                      "not supported; leave it False (CUDA IPC within a node, NVSHMEM across nodes)")
        expect(type(num_nvl_bytes) is int and num_nvl_bytes >= 0, "num_nvl_bytes", "a non-negative int",
               num_nvl_bytes)
        expect(type(num_rdma_bytes) is int and num_rdma_bytes >= 0, "num_rdma_bytes", "a non-negative int",
               num_rdma_bytes)
        expect(type(timeout_s) in (int, float) and 0 < timeout_s < math.inf, "timeout_s",
               "a positive, finite number of seconds", timeout_s)
        rank, size = group_rank_and_size(group)
        self._attach(create_backend(backend, group, rank, size, num_rdma_bytes, float(timeout_s),
                                    shrink=bool(enable_shrink), num_nvl_bytes=num_nvl_bytes, transport=transport),
                     bool(low_latency_mode))
        self.num_nvl_bytes = num_nvl_bytes
        self.explicitly_destroy = explicitly_destroy

    @classmethod
    def from_backend(cls, backend: Backend) -> Buffer:
        """A Buffer around an existing backend (e.g. one of several ranks emulated in one process)."""
        expect(isinstance(backend, Backend), "backend", "an ep_layer.backends.Backend", type(backend).__name__)
        buffer = cls.__new__(cls)
        buffer._attach(backend, True)
        buffer.num_nvl_bytes = backend.num_nvl_bytes
        buffer.explicitly_destroy = False
        return buffer

    def _attach(self, backend: Backend, low_latency_mode: bool) -> None:
        self.group = backend.group
        self.rank, self.group_size = backend.rank, backend.num_ranks
        self.num_rdma_bytes = backend.num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.enable_shrink = backend.shrink
        self.timeout_s = backend.timeout_s
        self._backend: Backend | None = backend
        self.backend_name = backend.name
        # The last _OUTSTANDING dispatches' records, by the id of their handle tuples, and by their slot.
        self._records: dict[int, _DispatchRecord] = {}
        self._slots: list[_DispatchRecord | None] = [None] * _OUTSTANDING
        self._num_dispatches = 0
        self._dispatch_checks: dict[tuple, DispatchSpec] = {}
        self._combine_checks: dict[tuple, _CombineCheck] = {}
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
        """DeepEP's SM budget for its normal kernels (even, as DeepEP's); the low-latency kernels size
        themselves."""
        check_positive_int(new_num_sms, "new_num_sms")
        expect(new_num_sms % 2 == 0, "new_num_sms", "an even number of SMs", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (DeepEP's `previous_event`); None on CPU."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's normal-mode tuning for `num_ranks`: accepted and ignored here (the defaults)."""
        check_positive_int(num_ranks, "num_ranks")
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's normal-mode tuning for `num_ranks`: accepted and ignored here (the defaults)."""
        check_positive_int(num_ranks, "num_ranks")
        return Config(Buffer.num_sms)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether our CUDA kernels were built for Hopper (sm_90a)."""
        from . import native

        return native.available() and "900" in (a.strip() for a in native.load().CUDA_ARCHS.split(","))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Forget outstanding dispatches and reset the backend's communication state."""
        backend = self._live()
        _check_low_latency(self.low_latency_mode, "clean_low_latency_buffer")
        check_positive_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", MAX_TOKENS_PER_RANK)
        check_positive_int(hidden, "hidden")
        check_experts(num_experts, self.group_size)
        self._forget_dispatches()
        backend.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's communication buffer as a flat `dtype` tensor from byte `offset` (or its first
        `size` elements viewed as `size`). Only the low-latency ("RDMA") buffer exists here."""
        if not use_rdma_buffer:
            raise NotImplementedError("get_local_buffer_tensor(use_rdma_buffer=False): ep-layer keeps no separate "
                                      "NVLink buffer (normal-mode messages are fresh tensors); pass "
                                      "use_rdma_buffer=True for the low-latency buffer")
        expect(isinstance(dtype, torch.dtype), "dtype", "a torch.dtype", dtype)
        expect(type(offset) is int and 0 <= offset <= self.num_rdma_bytes, "offset",
               f"a byte offset in [0, {self.num_rdma_bytes}]", offset)
        flat = self._live().local_buffer(offset)
        if flat.numel() % dtype.itemsize:
            flat = flat[:flat.numel() // dtype.itemsize * dtype.itemsize]
        flat = flat.view(dtype)
        if size is None:
            return flat
        want = math.prod(size)
        expect(want <= flat.numel(), "size", f"at most {flat.numel()} elements of {dtype} from offset {offset}",
               tuple(size))
        return flat[:want].view(size)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The side stream on which `async_finish` calls run."""
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream()
        return self._comm_stream

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
        self._forget_dispatches()

    def _live(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("Buffer: used after destroy()")
        return self._backend

    # ------------------------------------------------------------------ rank masking (enable_shrink)
    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write into int32 `mask_status` [num_ranks] which ranks this rank has masked (1) or not (0)."""
        backend = self._shrinking("low_latency_query_mask_buffer")
        expect(isinstance(mask_status, torch.Tensor), "mask_status", "a torch.Tensor", type(mask_status).__name__)
        device = backend.device or mask_status.device
        check_tensor(mask_status, "mask_status", torch.int32, (self.group_size,), device)
        backend.query_mask(mask_status)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask rank `rank_to_mask` (no more sends to or receives from it) or, with mask=False, unmask it."""
        backend = self._shrinking("low_latency_update_mask_buffer")
        expect(type(rank_to_mask) is int and 0 <= rank_to_mask < self.group_size, "rank_to_mask",
               f"a rank in [0, {self.group_size})", rank_to_mask)
        backend.update_mask(rank_to_mask, bool(mask))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._shrinking("low_latency_clean_mask_buffer").clean_mask()

    def _shrinking(self, op: str) -> Backend:
        backend = self._live()
        if not backend.shrink:
            raise RuntimeError(f"{op}: rank masking is off; build the Buffer with enable_shrink=True")
        return backend

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             rows_in_place: bool = False, **unknown: object):
        """Send each token to the ranks of its experts; returns (recv_x, recv_count, handle, event, hook).

        rows_in_place (ours, not DeepEP's; see `supports_rows_in_place`): recv_x is a `RowsInPlace` that
        names where each received row lies in the communication buffer, instead of a packed copy of the
        rows (one pass over HBM fewer, for GEMMs that read rows where they lie: ep_layer.moe's Triton
        kernels). Float32 scales only (not with use_ue8m0)."""
        if unknown:
            _refuse_unknown("low_latency_dispatch", unknown)
        recv_stats, wait_stats = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        with _no_torch_function():
            backend = self._backend or self._live()
            try:
                key = (type(x), x.shape, x.dtype, x.device, type(topk_idx), topk_idx.shape, topk_idx.dtype,
                       topk_idx.device, type(num_max_dispatch_tokens_per_rank), num_max_dispatch_tokens_per_rank,
                       type(num_experts), num_experts, recv_stats is not None and _meta(recv_stats),
                       wait_stats is not None and _meta(wait_stats), use_fp8, round_scale, use_ue8m0, async_finish,
                       return_recv_hook, rows_in_place)  # flags as given: 1 and True are one key, as they are alike
                spec = self._dispatch_checks.get(key)
            except (AttributeError, TypeError):  # not tensors, or unhashable arguments: the checks say which
                key, spec = None, None
            if spec is None:
                spec = self._check_dispatch(backend, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                            recv_stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                                            return_recv_hook, rows_in_place)
                if key is not None:
                    _remember_check(self._dispatch_checks, key, spec)
            if async_finish:
                return self._dispatch_async(backend, x, topk_idx, spec, recv_stats, wait_stats, rows_in_place)
            result = backend.dispatch(x, topk_idx, spec, recv_stats, wait_stats, hook=return_recv_hook,
                                      rows_in_place=rows_in_place)
            self._remember(result.handle, result.private, result.recv_count)
            if return_recv_hook:
                return result.recv_x, result.recv_count, result.handle, None, _once(result.receive,
                                                                                    "low_latency_dispatch")
            result.receive()
            return result.recv_x, result.recv_count, result.handle, None, None

    def _check_dispatch(self, backend: Backend, x: object, topk_idx: object, max_tokens: object,
                        num_experts: object, recv_stats: object, wait_stats: object, use_fp8: bool,
                        round_scale: bool, use_ue8m0: bool, async_finish: bool, return_recv_hook: bool,
                        rows_in_place: bool) -> DispatchSpec:
        """Every check of a dispatch's arguments (raises ValueError naming the argument); the spec."""
        _check_low_latency(self.low_latency_mode, "low_latency_dispatch")
        expect(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__)
        assert isinstance(x, torch.Tensor)
        device = backend.device or x.device
        x = check_tensor(x, "x", torch.bfloat16, (None, None), device)
        num_tokens, hidden = x.shape
        t = check_positive_int(max_tokens, "num_max_dispatch_tokens_per_rank", MAX_TOKENS_PER_RANK)
        e = check_experts(num_experts, self.group_size)
        check_topk(topk_idx, num_tokens, t, device)
        check_fp8_options(hidden, use_fp8, round_scale, use_ue8m0)
        num_local = e // self.group_size
        if recv_stats is not None:
            check_tensor(recv_stats, "cumulative_local_expert_recv_stats", torch.int32, (num_local,), device)
        if wait_stats is not None:
            check_tensor(wait_stats, "dispatch_wait_recv_cost_stats", torch.int64, (self.group_size,), device)
        _check_modes(async_finish, return_recv_hook)
        if rows_in_place:
            expect(backend.supports_rows_in_place, "rows_in_place", f"False for the {backend.name} backend "
                   "(only the cuda backend leaves rows in place)", rows_in_place)
            expect(not use_ue8m0, "rows_in_place", "False with use_ue8m0 (rows in place keep float32 scales)",
                   rows_in_place)
        return DispatchSpec(t, hidden, e, bool(use_fp8), bool(round_scale), bool(use_ue8m0))

    def _dispatch_async(self, backend: Backend, x: torch.Tensor, topk_idx: torch.Tensor, spec: DispatchSpec,
                        recv_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, rows_in_place: bool):
        def call():
            result = backend.dispatch(x, topk_idx, spec, recv_stats, wait_stats, hook=False,
                                      rows_in_place=rows_in_place)
            self._remember(result.handle, result.private, result.recv_count)
            result.receive()
            return result

        result, event = self._on_comm_stream(call, (x, topk_idx))
        return result.recv_x, result.recv_count, result.handle, event, None

    # ------------------------------------------------------------------ combine
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, *, overlap: bool = False,
                            packed_recv_count: torch.Tensor | None = None, comp_signal: torch.Tensor | None = None,
                            block_m: int = 64, threshold: int = 0, num_sms: int | None = None,
                            src_signals: torch.Tensor | None = None, src_signal_expect_value: int = 0,
                            **unknown: object):
        """Weighted sum of each token's expert outputs back on its rank; returns (combined_x, event, hook).

        Single-batch overlap, as DeepEP's forks take it (SGLang's `--enable-single-batch-overlap`): with
        `overlap=True` the expert GEMM may still be writing x on another stream, and the send of each row
        waits for its completion signal instead: on Hopper comp_signal (int32, ceil(R*T / block_m) per local
        expert; rows [j * block_m, (j + 1) * block_m) of expert l are done once comp_signal[l * ceil(R*T /
        block_m) + j] >= threshold) with packed_recv_count (the dispatch's recv_count); on Blackwell
        src_signals (int32 or uint32 [E_l]; expert l is done once src_signals[l] >= src_signal_expect_value).
        num_sms: at most this many SMs send (the rest stay with the GEMM). Waits are bounded by timeout_s.
        The keywords and their meaning as SGLang 0.5.17 passes them (sglang/srt/layers/moe/token_dispatcher/
        deepep.py, `_combine_core`; sglang/srt/batch_overlap/single_batch_overlap.py, `compute_overlap_args`)
        and as sgl-project/DeepEP's deep_ep/buffers/legacy.py (66bdc39) names the Blackwell form."""
        if unknown:
            _refuse_unknown("low_latency_combine", unknown)
        wait_stats = combine_wait_recv_cost_stats
        with _no_torch_function():
            backend = self._backend or self._live()
            record = self._record(handle)
            signals = self._send_signals(record, handle, overlap, packed_recv_count, comp_signal, block_m, threshold,
                                         src_signals, src_signal_expect_value) if overlap else None
            if num_sms is not None:
                check_positive_int(num_sms, "num_sms", 1 << 16)
            try:
                key = (type(x), x.shape, x.dtype, x.device, type(topk_idx), topk_idx.shape, topk_idx.dtype,
                       topk_idx.device, type(topk_weights), topk_weights.shape, topk_weights.dtype,
                       topk_weights.device, handle[2:], out is not None and _meta(out),
                       wait_stats is not None and _meta(wait_stats), use_logfmt, zero_copy, async_finish,
                       return_recv_hook)
                checked = self._combine_checks.get(key)
            except (AttributeError, TypeError):
                key, checked = None, None
            if checked is None:
                checked = self._check_combine(backend, x, topk_idx, topk_weights, handle, use_logfmt, async_finish,
                                              return_recv_hook, out, wait_stats)
                if key is not None:
                    _remember_check(self._combine_checks, key, checked)
            if out is None and (async_finish or return_recv_hook):  # written on another stream, or later
                out = torch.empty(topk_idx.shape[0], handle[3], dtype=torch.bfloat16, device=checked.device)
            elif out is None:
                out = backend.combine_output(topk_idx.shape[0], handle[3], checked.device)
            if zero_copy:
                x = self._combine_buffer(record, handle, checked.device)
            combined = out
            if async_finish:
                def call() -> None:
                    backend.combine(x, topk_idx, topk_weights, handle, record.private, combined, wait_stats,
                                    hook=False, slot=record.slot, signals=signals, send_sms=num_sms)()

                # `out` too: written on the comm stream, it must not go back to the allocator before that write.
                _, event = self._on_comm_stream(call, (x, topk_idx, topk_weights, out))
                return out, event, None
            receive = backend.combine(x, topk_idx, topk_weights, handle, record.private, out, wait_stats,
                                      hook=return_recv_hook, slot=record.slot, signals=signals, send_sms=num_sms)
            if return_recv_hook:
                return out, None, _once(receive, "low_latency_combine")
            receive()
            return out, None, None

    def _check_combine(self, backend: Backend, x: object, topk_idx: object, topk_weights: object, handle: Handle,
                       use_logfmt: bool, async_finish: bool, return_recv_hook: bool, out: object,
                       wait_stats: object) -> _CombineCheck:
        """Every check of a combine's arguments (raises ValueError naming the argument)."""
        expect(not use_logfmt, "use_logfmt", "False (LogFMT combine is not supported)", use_logfmt)
        _, _, t, hidden, e = handle
        num_local, rows = e // self.group_size, self.group_size * t
        expect(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__)
        assert isinstance(x, torch.Tensor)
        device = backend.device or x.device
        check_tensor(x, "x", torch.bfloat16, (num_local, rows, hidden), device)
        expect(isinstance(topk_idx, torch.Tensor), "topk_idx", "a torch.Tensor", type(topk_idx).__name__)
        assert isinstance(topk_idx, torch.Tensor)
        num_tokens, k = check_topk(topk_idx, topk_idx.shape[0], t, device, "topk_idx").shape
        check_tensor(topk_weights, "topk_weights", torch.float32, (num_tokens, k), device)
        if out is not None:
            check_tensor(out, "out", torch.bfloat16, (num_tokens, hidden), device)
        if wait_stats is not None:
            check_tensor(wait_stats, "combine_wait_recv_cost_stats", torch.int64, (self.group_size,), device)
        _check_modes(async_finish, return_recv_hook)
        return _CombineCheck(device, num_local)

    def _send_signals(self, record: _DispatchRecord, handle: Handle, overlap: object, packed_recv_count: object,
                      comp_signal: object, block_m: object, threshold: object, src_signals: object,
                      expect_value: object) -> SendSignals:
        """The checked overlap arguments of a combine (`overlap=True`), as the signals its send waits for."""
        expect(overlap is True, "overlap", "a bool", overlap)
        _, _, t, _, e = handle
        num_local, rows = e // self.group_size, self.group_size * t
        device = handle[0].device
        hopper, blackwell = comp_signal is not None, src_signals is not None
        expect(hopper != blackwell, "comp_signal", "with overlap=True, either comp_signal (with packed_recv_count, "
               "block_m, threshold) or src_signals (with src_signal_expect_value), not both or neither",
               "both" if hopper else "neither")
        if blackwell:
            expect(isinstance(src_signals, torch.Tensor) and src_signals.dtype in (torch.int32, torch.uint32),
                   "src_signals", "an int32 or uint32 tensor", getattr(src_signals, "dtype", type(src_signals)))
            signals = check_tensor(src_signals.view(torch.int32), "src_signals", torch.int32, (num_local,), device)
            value = check_positive_int(expect_value, "src_signal_expect_value", (1 << 31) - 1)
            return SendSignals(signals, rows, 1, value)
        check_positive_int(block_m, "block_m", (1 << 31) - 1)
        per_expert = -(-rows // block_m)
        expect(isinstance(comp_signal, torch.Tensor) and comp_signal.dim() == 1
               and comp_signal.numel() >= num_local * per_expert, "comp_signal",
               f"an int32 tensor of at least {num_local} x {per_expert} signals (E_l x ceil(R*T / block_m))",
               list(comp_signal.shape) if isinstance(comp_signal, torch.Tensor) else type(comp_signal).__name__)
        check_tensor(comp_signal, "comp_signal", torch.int32, (comp_signal.shape[0],), device)
        check_tensor(packed_recv_count, "packed_recv_count", torch.int32, (num_local,), device)
        expect(packed_recv_count.data_ptr() == record.recv_count_ptr, "packed_recv_count",
               "the recv_count of the dispatch that returned this handle", "another tensor")
        value = check_positive_int(threshold, "threshold", (1 << 31) - 1)
        return SendSignals(comp_signal, block_m, per_expert, value)

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """The bf16 [E_l, R*T, H] buffer that `low_latency_combine(..., zero_copy=True)` reads for `handle`."""
        self._live()
        record = self._record(handle)
        return self._combine_buffer(record, handle, handle[0].device)

    @property
    def supports_rows_in_place(self) -> bool:
        """Whether `low_latency_dispatch(..., rows_in_place=True)` works here (the cuda backend)."""
        return self._live().supports_rows_in_place

    @property
    def signals_waited_on_device(self) -> bool:
        """Whether a combine with overlap signals may run beside the GEMM that sets them, not after it in
        stream order (the cuda backend waits for them on the device; the reference backend on the host)."""
        return self._live().signals_waited_on_device

    @property
    def ranks_on_this_gpu(self) -> int:
        """The group's ranks that share this rank's GPU, itself included (emulated ranks: all of them)."""
        return self._live().ranks_on_this_gpu

    # ------------------------------------------------------------------ shared plumbing
    def _on_comm_stream(self, call: Callable, inputs: tuple[torch.Tensor, ...]) -> tuple[object, EventOverlap]:
        """`async_finish`: run both halves of `call` on the comm stream (GPU tensors) or now (CPU); the
        event marks its end, and holds the inputs until the caller has waited for it."""
        if not inputs[0].is_cuda:
            return call(), EventOverlap(None, inputs)
        stream = self.get_comm_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = call()
            event = torch.cuda.Event()
            event.record(stream)
        for t in inputs:
            t.record_stream(stream)
        return result, EventOverlap(event, inputs)

    def _remember(self, handle: Handle, private: object, recv_count: torch.Tensor) -> None:
        slot = self._num_dispatches % _OUTSTANDING
        self._num_dispatches += 1
        records, replaced = self._records, self._slots[slot]
        if replaced is not None and records.get(replaced.handle_id) is replaced:
            del records[replaced.handle_id]
        record = self._slots[slot] = _DispatchRecord.of(handle, slot, private, recv_count)
        records[record.handle_id] = record  # a dead handle's id can come back: its record is replaced

    def _record(self, handle: object) -> _DispatchRecord:
        """The dispatch that returned `handle` (the tuple itself: a later dispatch may return the same
        tensors, recycled, so only the tuple tells the two apart)."""
        if type(handle) is tuple and len(handle) == 5:
            record = self._records.get(id(handle))
            if record is not None and record.src_info() is handle[0]:
                return record
        ok = isinstance(handle, tuple) and len(handle) == 5 and isinstance(handle[0], torch.Tensor)
        expect(ok, "handle", "the handle returned by low_latency_dispatch", type(handle).__name__)
        raise ValueError(f"handle: not the handle tuple of one of this Buffer's last {_OUTSTANDING} dispatches "
                         "(at most two results may be outstanding; pass the tuple as dispatch returned it)")

    def _forget_dispatches(self) -> None:
        self._records.clear()
        self._slots = [None] * _OUTSTANDING
        self._combine_buffers.clear()

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


def _check_low_latency(low_latency_mode: bool, op: str) -> None:
    if not low_latency_mode:
        raise RuntimeError(f"{op}: this Buffer was made with low_latency_mode=False (normal mode only); make it "
                           "with low_latency_mode=True and num_rdma_bytes >= get_low_latency_rdma_size_hint(...)")


def _check_modes(async_finish: bool, return_recv_hook: bool) -> None:
    expect(not (async_finish and return_recv_hook), "async_finish",
           "False when return_recv_hook=True (the two are exclusive)", async_finish)


def _remember_check(cache: dict, key: tuple, value: object) -> None:
    if len(cache) >= _MAX_CACHED_CHECKS:
        cache.clear()
    cache[key] = value
