"""DeepEP's normal (high-throughput) mode on `Buffer`: `get_dispatch_layout`, `dispatch` and `combine`
with DeepEP's names, defaults and returns (docs/design.md section 2, normal mode), for prefill batches
larger than a low-latency buffer holds.

The mixin checks every argument (a ValueError naming it), runs the call on the stream DeepEP's flags
ask for (`previous_event`, `async_finish`, `allocate_on_comm_stream`) and hands the exchange to the
backend. Unlike the low-latency calls, a non-cached dispatch returns Python counts, so it waits for the
host unless `num_worst_tokens` sizes its outputs in advance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backends import Backend
from .backends.normal import NormalCombineArgs, NormalDispatchArgs, NormalHandle
from .checks import check_experts, check_tensor, expect
from .config import Config
from .dispatch_layout import dispatch_layout
from .event import EventOverlap
from .layout import MAX_TOPK

NormalX = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class NormalMode:
    """The normal-mode calls of `Buffer` (a mixin: it uses the Buffer's backend, rank count and comm stream)."""

    group_size: int
    num_nvl_bytes: int
    num_sms: int
    _live: Callable[[], Backend]
    get_comm_stream: Callable[[], torch.cuda.Stream]

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank (None: one node), num_tokens_per_expert,
        is_token_in_rank, event) of int64 top-k ids `topk_idx` [T, K] (-1: no expert)."""
        backend = self._normal_backend("get_dispatch_layout")
        expect(isinstance(topk_idx, torch.Tensor), "topk_idx", "a torch.Tensor", type(topk_idx).__name__)
        device = backend.device or topk_idx.device
        _check_topk_idx(topk_idx, None, device)
        e = check_experts(num_experts, self.group_size)
        _check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)

        def call() -> tuple[torch.Tensor, ...]:
            return dispatch_layout(topk_idx, e, self.group_size)

        (per_rank, per_expert, in_rank), event = self._run(call, (topk_idx,), previous_event, async_finish,
                                                           allocate_on_comm_stream)
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x: NormalX, handle: NormalHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None, num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token once to every rank that holds one of its experts; returns (recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event). With a
        `handle` (a cached dispatch) the tokens go where that dispatch sent them, and only recv_x and
        the event come back."""
        backend = self._normal_backend("dispatch")
        columns = _split_x(x)
        device = backend.device or columns[0].device
        num_tokens = _check_x_columns(columns, device)
        expect(num_tokens_per_rdma_rank is None, "num_tokens_per_rdma_rank",
               "None (normal mode runs inside one node; get_dispatch_layout returns None)",
               type(num_tokens_per_rdma_rank).__name__)
        expect(type(expert_alignment) is int and expert_alignment > 0, "expert_alignment", "a positive int",
               expert_alignment)
        expect(type(num_worst_tokens) is int and num_worst_tokens >= 0, "num_worst_tokens", "a non-negative int",
               num_worst_tokens)
        _check_config(config)
        _check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        r = self.group_size
        if handle is not None:
            _check_handle(handle, r, num_tokens, device)
            expect(topk_idx is None, "topk_idx", "None with a handle (a cached dispatch re-sends its layout)",
                   type(topk_idx).__name__)
            expect(topk_weights is None, "topk_weights", "None with a handle (a cached dispatch re-sends its "
                   "layout)", type(topk_weights).__name__)
            args = NormalDispatchArgs(columns, handle.is_token_in_rank, None, None, None, None, 0,
                                      handle.recv_src_idx.shape[0], handle, self._sms(config))
        else:
            for value, name in ((num_tokens_per_rank, "num_tokens_per_rank"), (is_token_in_rank, "is_token_in_rank"),
                                (num_tokens_per_expert, "num_tokens_per_expert")):
                expect(value is not None, name, "a tensor from get_dispatch_layout (or a handle: a cached dispatch)",
                       None)
            check_tensor(num_tokens_per_rank, "num_tokens_per_rank", torch.int32, (r,), device)
            check_tensor(is_token_in_rank, "is_token_in_rank", torch.bool, (num_tokens, r), device)
            check_tensor(num_tokens_per_expert, "num_tokens_per_expert", torch.int32, (None,), device)
            e = check_experts(num_tokens_per_expert.shape[0], r, "num_tokens_per_expert")
            if topk_idx is not None:
                _check_topk_idx(topk_idx, num_tokens, device)
            if topk_weights is not None:
                expect(topk_idx is not None, "topk_weights", "None without topk_idx", "a tensor")
                check_tensor(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape), device)
            args = NormalDispatchArgs(columns, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                                      topk_idx, topk_weights, e, num_worst_tokens, None, self._sms(config))

        inputs = tuple(t for t in (*columns, args.is_token_in_rank, topk_idx, topk_weights) if t is not None)
        result, event = self._run(lambda: backend.normal_dispatch(args), inputs, previous_event, async_finish,
                                  allocate_on_comm_stream)
        recv_x = result.columns[0] if len(result.columns) == 1 else result.columns
        if handle is not None:
            return recv_x, None, None, None, None, event
        counts = result.num_recv_tokens_per_expert
        aligned = [] if counts is None else [-(-c // expert_alignment) * expert_alignment for c in counts]
        return recv_x, result.topk_idx, result.topk_weights, aligned, result.handle, event

    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sum, on each token's rank, the rows that the ranks it went to send back (no weights applied),
        plus `bias`; returns (combined_x, combined_topk_weights, event)."""
        backend = self._normal_backend("combine")
        expect(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__)
        device = backend.device or x.device
        expect(isinstance(handle, NormalHandle), "handle", "the handle a normal-mode dispatch returned",
               type(handle).__name__)
        rows = handle.recv_src_idx.shape[0]
        num_tokens = handle.is_token_in_rank.shape[0]
        check_tensor(x, "x", torch.bfloat16, (rows, None), device)
        hidden = x.shape[1]
        _check_handle(handle, self.group_size, num_tokens, device)
        if topk_weights is not None:
            check_tensor(topk_weights, "topk_weights", torch.float32, (rows, None), device)
        biases = _split_bias(bias)
        named = [(f"bias[{i}]", b) for i, b in enumerate(bias) if b is not None] if isinstance(bias, tuple) else \
            [("bias", b) for b in biases]
        for name, b in named:
            check_tensor(b, name, torch.bfloat16, (num_tokens, hidden), device)
        _check_config(config)
        _check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        args = NormalCombineArgs(x, topk_weights, biases, handle, self._sms(config))
        inputs = tuple(t for t in (x, topk_weights, *biases) if t is not None)
        (combined, weights), event = self._run(lambda: backend.normal_combine(args), inputs, previous_event,
                                               async_finish, allocate_on_comm_stream)
        return combined, weights, event

    def get_next_combine_buffer(self, handle: NormalHandle, hidden: int) -> torch.Tensor:
        """bf16 [N, hidden], one row per row `handle`'s dispatch received: write the rows of the next
        combine here and pass this tensor as its `x`, and the combine reads them in place instead of
        copying them (ep-layer's, not DeepEP's). The cuda backend returns a view of its buffer after a
        wait, on the current stream, for every peer to finish reading the previous combine's rows; until
        that combine, no other combine may run on this Buffer. Other backends return a new tensor."""
        backend = self._normal_backend("get_next_combine_buffer")
        expect(isinstance(handle, NormalHandle), "handle", "the handle a normal-mode dispatch returned",
               type(handle).__name__)
        expect(type(hidden) is int and hidden > 0, "hidden", "a positive int", hidden)
        return backend.normal_combine_buffer(handle.recv_src_idx.shape[0], hidden, handle.recv_src_idx.device)

    def _sms(self, config: Config | None) -> int:
        """The SMs a call's kernels may use: the config's, else the Buffer's (Buffer.set_num_sms)."""
        return max(1, config.num_sms if config is not None else self.num_sms)

    def _normal_backend(self, op: str) -> Backend:
        backend = self._live()
        if self.num_nvl_bytes <= 0:
            raise RuntimeError(f"{op}: this Buffer has no normal-mode buffer (num_nvl_bytes=0); make it with "
                               "num_nvl_bytes >= Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)")
        return backend

    def _run(self, call: Callable, inputs: tuple[torch.Tensor, ...], previous_event: EventOverlap | None,
             async_finish: bool, allocate_on_comm_stream: bool) -> tuple[object, EventOverlap]:
        """`call` on the stream DeepEP's flags name: the current one, or with `async_finish` the comm stream
        (the event marks the end); after `previous_event` either way. Outputs made on the comm stream
        belong to the current stream unless `allocate_on_comm_stream`."""
        if not inputs[0].is_cuda:
            return call(), EventOverlap(None)
        if not async_finish:
            if previous_event is not None:
                previous_event.current_stream_wait()
            return call(), EventOverlap(None)
        compute = torch.cuda.current_stream()
        stream = self.get_comm_stream()
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if previous_event is not None:
                previous_event.current_stream_wait()
            result = call()
            event = torch.cuda.Event()
            event.record(stream)
        for t in inputs:
            t.record_stream(stream)
        if not allocate_on_comm_stream:
            for t in _tensors_of(result):
                t.record_stream(compute)
        return result, EventOverlap(event, inputs)


def _split_x(x: object) -> tuple[torch.Tensor, ...]:
    if isinstance(x, tuple):
        expect(len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x), "x",
               "a bf16 tensor, or a tuple (e4m3 data, scales)", f"a tuple of {len(x)}")
        return x
    expect(isinstance(x, torch.Tensor), "x", "a bf16 tensor, or a tuple (e4m3 data, scales)", type(x).__name__)
    return (x,)


def _check_x_columns(columns: tuple[torch.Tensor, ...], device: torch.device) -> int:
    """Rows of x: bf16 [T, H], or e4m3 [T, H] with float32 scales [T] or [T, S] (UE8M0: int32 [T, S])."""
    if len(columns) == 1:
        x = check_tensor(columns[0], "x", torch.bfloat16, (None, None), device)
    else:
        x = check_tensor(columns[0], "x[0]", torch.float8_e4m3fn, (None, None), device)
        scales = columns[1]
        expect(scales.dtype in (torch.float32, torch.int32), "x[1]", "float32 scales (UE8M0: int32)", scales.dtype)
        check_tensor(scales, "x[1]", scales.dtype, (x.shape[0],) + (None,) * (scales.dim() - 1), device)
        expect(scales.dim() in (1, 2), "x[1]", "scales of shape [T] or [T, S]", list(scales.shape))
    expect(x.shape[1] > 0 and x.shape[1] * x.element_size() % 16 == 0, "x",
           "rows of a positive multiple of 16 bytes", f"hidden {x.shape[1]}")
    return x.shape[0]


def _check_topk_idx(topk_idx: object, num_tokens: int | None, device: torch.device) -> None:
    t = check_tensor(topk_idx, "topk_idx", torch.int64, (num_tokens, None), device)
    expect(0 < t.shape[1] <= MAX_TOPK, "topk_idx", f"1 to {MAX_TOPK} experts per token", t.shape[1])


def _check_handle(handle: object, num_ranks: int, num_tokens: int, device: torch.device) -> None:
    expect(isinstance(handle, NormalHandle), "handle", "the handle a normal-mode dispatch returned",
           type(handle).__name__)
    assert isinstance(handle, NormalHandle)
    expect(handle.rank_prefix_matrix.shape == (num_ranks, num_ranks) and handle.rank_prefix_matrix.device == device,
           "handle", f"a handle of a dispatch among {num_ranks} ranks on {device}", "another group's")
    expect(handle.is_token_in_rank.shape[0] == num_tokens, "x",
           f"the {handle.is_token_in_rank.shape[0]} tokens of the dispatch that made `handle`", f"{num_tokens} tokens")


def _split_bias(bias: object) -> tuple[torch.Tensor, ...]:
    if bias is None:
        return ()
    if isinstance(bias, tuple):
        expect(len(bias) == 2, "bias", "a tensor, or a tuple of two (either may be None)", f"a tuple of {len(bias)}")
        return tuple(b for b in bias if b is not None)
    expect(isinstance(bias, torch.Tensor), "bias", "None, a tensor, or a tuple of two", type(bias).__name__)
    return (bias,)


def _check_config(config: object) -> None:
    expect(config is None or isinstance(config, Config), "config", "None or an ep_layer.Config (deep_ep.Config)",
           type(config).__name__)


def _check_stream_flags(previous_event: object, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    expect(previous_event is None or isinstance(previous_event, EventOverlap), "previous_event",
           "None or an EventOverlap (Buffer.capture())", type(previous_event).__name__)
    if allocate_on_comm_stream:
        expect(async_finish and previous_event is not None, "allocate_on_comm_stream",
               "True only with async_finish=True and a previous_event (as DeepEP)", allocate_on_comm_stream)


def _tensors_of(result: object) -> list[torch.Tensor]:
    """The tensors in a call's result (nested tuples, NamedTuples and lists)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for part in result for t in _tensors_of(part)]
    return []
