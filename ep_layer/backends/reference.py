"""The reference backend: plain PyTorch and torch.distributed point-to-point messages.

It is the executable form of docs/design.md section 2 and the oracle of every test: each step is the
obvious one, in the order the design states it. Works on CPU (gloo), on GPU (NCCL) and alone.

Latency stats are host wall time (time.perf_counter_ns) of the send half plus the receive half,
recorded when the receive half returns (calls that raise are not recorded). On CUDA devices that is
host time too (launches, and whatever the exchange waits for), not the time the work takes on the GPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..checks import check_topk_values
from ..errors import overlap_signal_timeout
from ..latency import HostLatencyRecorder, LatencyHistogram
from ..quant import per_token_cast_to_fp8
from .base import Backend, DispatchResult, DispatchSpec, Handle, ReceiveHalf, SendSignals, empty_recv_x
from .exchange import PeerExchange
from .normal import NormalCombineArgs, NormalDispatchArgs, NormalDispatchResult
from .reference_normal import ReferenceNormalMode

_DISPATCH, _COMBINE = 1, 2
# Header each rank sends every peer before the data: the operation, what ranks must agree on, rows.
_OP, _T, _H, _E, _FLAGS, _ROWS = range(6)
_HEADER_LEN = 6
_ARG_NAMES = ("operation", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts",
              "fp8 flags (use_fp8 | round_scale << 1 | use_ue8m0 << 2)")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a 2-D tensor's rows as uint8 so that any dtype travels through any process group."""
    width = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).view(t.shape[0], width)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A fresh copy: a column slice with one row or none counts as contiguous but keeps the parent's
    # row stride or storage offset, which view(dtype) rejects.
    return b.clone(memory_format=torch.contiguous_format).view(dtype)


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                 num_rdma_bytes: int, timeout_s: float, shrink: bool = False) -> None:
        super().__init__(group, rank, num_ranks, num_rdma_bytes, timeout_s, shrink)
        self._masked: set[int] | None = set() if shrink else None  # shared with the exchange
        self._exchange = PeerExchange(group, timeout_s, self._masked)
        self._normal = ReferenceNormalMode(self._exchange, rank, num_ranks)
        self._latency = HostLatencyRecorder()
        self._device = None
        if num_ranks > 1 and dist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        elif num_ranks > 1:
            self._device = torch.device("cpu")

    @property
    def device(self) -> torch.device | None:
        return self._device

    def latency_stats(self) -> dict[str, LatencyHistogram]:
        return self._latency.snapshot()

    def local_buffer(self, offset: int) -> torch.Tensor:
        """Empty: the reference backend keeps no communication buffer (messages are fresh tensors)."""
        del offset
        return torch.zeros(0, dtype=torch.uint8, device=self._device or "cpu")

    def normal_dispatch(self, args: NormalDispatchArgs) -> NormalDispatchResult:
        return self._normal.dispatch(args)

    def normal_combine(self, args: NormalCombineArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._normal.combine(args)

    # ---------------------------------------------------------------- rank masking
    def _is_masked(self, rank: int) -> bool:
        return self._masked is not None and rank in self._masked

    def query_mask(self, out: torch.Tensor) -> None:
        out.copy_(torch.tensor([int(self._is_masked(r)) for r in range(self.num_ranks)], dtype=torch.int32))

    def update_mask(self, rank: int, masked: bool) -> None:
        assert self._masked is not None
        if masked:
            self._masked.add(rank)
        else:
            self._masked.discard(rank)

    def clean_mask(self) -> None:
        assert self._masked is not None
        self._masked.clear()

    def _timed(self, op: str, start_ns: int, receive: Callable[[], None]) -> ReceiveHalf:
        """`receive`, recording the call's latency when it returns: the send half (from `start_ns` to
        now) plus the receive half; the time between them (the caller's, with a hook) is not counted."""
        send_ns = time.perf_counter_ns() - start_ns

        def timed() -> None:
            begin = time.perf_counter_ns()
            receive()
            self._latency.record(op, send_ns + time.perf_counter_ns() - begin)

        return timed

    # ---------------------------------------------------------------- headers
    def _exchange_headers(self, what: str, mine: list[int], rows_to: list[int],
                          device: torch.device, wait_stats: torch.Tensor | None) -> list[int]:
        """Send each peer our arguments and its row count; check all ranks agree; return rows from each
        (0 from a masked rank)."""
        sends = [torch.tensor([*mine, rows], dtype=torch.int64, device=device) for rows in rows_to]
        recvs = [torch.empty(_HEADER_LEN, dtype=torch.int64, device=device) for _ in rows_to]
        pending = self._exchange.start(what, sends, recvs)
        self._add_wait(wait_stats, pending.wait())
        headers = {r: h.tolist() for r, h in enumerate(pending.recvs) if h is not None}
        for field, name in enumerate(_ARG_NAMES):
            values = {r: h[field] for r, h in headers.items()}
            if len(set(values.values())) > 1:
                raise ValueError(f"{what}: ranks disagree on {name}: " +
                                 ", ".join(f"rank {r} has {v}" for r, v in values.items()))
        return [headers[r][_ROWS] if r in headers else 0 for r in range(self.num_ranks)]

    @staticmethod
    def _add_wait(wait_stats: torch.Tensor | None, waited_ns: list[int]) -> None:
        if wait_stats is not None:
            wait_stats.add_(torch.tensor(waited_ns, dtype=wait_stats.dtype, device=wait_stats.device))

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, spec: DispatchSpec,
                 recv_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, *,
                 hook: bool, rows_in_place: bool = False) -> DispatchResult:
        del hook, rows_in_place  # the receive half is where the exchange happens either way; rows are copied
        start = time.perf_counter_ns()
        result = self._dispatch(x, topk_idx, spec, recv_stats, wait_stats)
        return result._replace(receive=self._timed("dispatch", start, result.receive))

    def _dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, spec: DispatchSpec,
                  recv_stats: torch.Tensor | None, wait_stats: torch.Tensor | None) -> DispatchResult:
        check_topk_values(topk_idx, spec.num_experts)
        num_ranks, t, h = self.num_ranks, spec.max_tokens, spec.hidden
        num_local = spec.num_experts // num_ranks
        device = x.device

        if spec.use_fp8:
            data, scales = per_token_cast_to_fp8(x, spec.round_scale, spec.use_ue8m0)
            columns = [data, scales]
        else:
            columns = [x]
        # One message per destination: for each token that has an expert there (ascending t), the
        # token index, a mask of which of the destination's local experts it goes to, and its data.
        dest_of = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
        sends, rows_to = [], []
        for dest in range(num_ranks):
            hits = dest_of == dest
            tokens = hits.any(dim=1).nonzero().squeeze(1)
            local = (topk_idx[tokens] - dest * num_local).masked_fill(~hits[tokens], num_local)
            mask = torch.zeros(len(tokens), num_local + 1, dtype=torch.uint8, device=device)
            mask.scatter_(1, local, 1)
            row = [tokens.unsqueeze(1), mask[:, :num_local]] + [c[tokens] for c in columns]
            sends.append(torch.cat([_as_bytes(c) for c in row], dim=1))
            rows_to.append(len(tokens))

        flags = int(spec.use_fp8) | int(spec.round_scale) << 1 | int(spec.use_ue8m0) << 2
        rows_from = self._exchange_headers(
            "low_latency_dispatch", [_DISPATCH, t, h, spec.num_experts, flags], rows_to, device, wait_stats)
        row_bytes = sends[0].shape[1]
        recvs = [torch.empty(n, row_bytes, dtype=torch.uint8, device=device) for n in rows_from]
        pending = self._exchange.start("low_latency_dispatch", sends, recvs)

        # Outputs exist from the send half on; the receive half fills them.
        rows = num_ranks * t
        recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
        src_info = torch.empty(num_local, rows, dtype=torch.int32, device=device)
        layout_range = torch.empty(num_local, num_ranks, dtype=torch.int64, device=device)
        recv_x = empty_recv_x(spec, num_local, rows, device)
        out_columns = list(recv_x) if spec.use_fp8 else [recv_x]
        widths = [8, num_local] + [c.shape[-1] * c.element_size() for c in out_columns]

        def receive() -> None:
            self._add_wait(wait_stats, pending.wait())
            arrived = [recv if recv is not None else recvs[0][:0] for recv in pending.recvs]  # masked: none
            got = torch.cat(arrived)  # ordered by source rank, then token
            source = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                             torch.tensor([len(recv) for recv in arrived], device=device))
            fields = got.split(widths, dim=1)
            token = _from_bytes(fields[0], torch.int64).squeeze(1)
            mask = fields[1].bool()
            payload = [_from_bytes(f, c.dtype).view(-1, *c.shape[2:]) for f, c in zip(fields[2:], out_columns)]
            # A received row per (message row, local expert of its mask): an expert's rows in (source, token)
            # order, each at its rank among them.
            row, expert = mask.nonzero(as_tuple=True)  # by message row, then expert
            order = torch.sort(expert, stable=True).indices
            row, expert = row[order], expert[order]
            counts = torch.bincount(expert, minlength=num_local)
            place = torch.arange(len(expert), device=device) - (torch.cumsum(counts, 0) - counts)[expert]
            recv_count.copy_(counts)
            src_info[expert, place] = token[row].to(torch.int32)
            per_source = torch.bincount(expert * num_ranks + source[row], minlength=num_local * num_ranks)
            per_source = per_source.view(num_local, num_ranks)
            layout_range.copy_((torch.cumsum(per_source, 1) - per_source) << 32 | per_source)
            for out, values in zip(out_columns, payload):
                out[expert, place] = values[row]
            if recv_stats is not None:
                recv_stats.add_(recv_count)

        return DispatchResult(recv_x, recv_count, (src_info, layout_range, t, h, spec.num_experts),
                              receive)

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: Handle, private: object, out: torch.Tensor,
                wait_stats: torch.Tensor | None, *, hook: bool, slot: int, signals: SendSignals | None = None,
                send_sms: int | None = None) -> ReceiveHalf:
        # The receive half is where the exchange completes either way; no zero-copy buffers; no SMs to spare.
        del hook, slot, send_sms
        start = time.perf_counter_ns()
        if signals is not None:
            self._wait_for_signals(signals, handle)
        receive = self._combine(x, topk_idx, topk_weights, handle, out, wait_stats)
        return self._timed("combine", start, receive)

    def _wait_for_signals(self, signals: SendSignals, handle: Handle) -> None:
        """Single-batch overlap: before anything of x is read, every received row's signal has reached the
        threshold (polled on the host: a GEMM on another stream may still be writing x), within timeout_s."""
        layout_range = handle[1]
        recv_count = (layout_range & 0xFFFFFFFF).sum(dim=1).tolist()
        needed = [signals.index(expert, row) for expert, count in enumerate(recv_count)
                  for row in range(0, count, signals.rows)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            values = signals.signals.tolist()
            if all(values[i] >= signals.threshold for i in needed):
                return
            if time.monotonic() > deadline:
                late = [i for i in needed if values[i] < signals.threshold]
                raise overlap_signal_timeout(self.rank, late[:8], self.timeout_s, signals.threshold)
            time.sleep(50e-6)

    def _combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
                 out: torch.Tensor, wait_stats: torch.Tensor | None) -> ReceiveHalf:
        src_info, layout_range, t, h, num_experts = handle
        check_topk_values(topk_idx, num_experts)
        num_ranks = self.num_ranks
        num_local = num_experts // num_ranks
        device = x.device

        # Send each source rank back, for every row it dispatched here: (token, global expert, y). An expert's
        # rows hold its sources' ranges in source order (layout_range), so the received rows, expert by
        # expert, come from the sources that repeat_interleave names.
        counts = layout_range & 0xFFFFFFFF  # [E_l, R]
        per_expert = counts.sum(1)
        expert = torch.repeat_interleave(torch.arange(num_local, device=device), per_expert)
        place = torch.arange(len(expert), device=device) - (torch.cumsum(per_expert, 0) - per_expert)[expert]
        source_of = torch.repeat_interleave(torch.arange(num_ranks, device=device).repeat(num_local),
                                            counts.flatten())
        sends, rows_to = [], []
        for source in range(num_ranks):
            mine = source_of == source
            e, p = expert[mine], place[mine]
            ids = torch.stack([src_info[e, p].to(torch.int64), self.rank * num_local + e], 1)
            sends.append(torch.cat([_as_bytes(ids), _as_bytes(x[e, p])], dim=1))
            rows_to.append(sends[-1].shape[0])

        rows_from = self._exchange_headers(
            "low_latency_combine", [_COMBINE, t, h, num_experts, 0], rows_to, device, wait_stats)
        recvs = [torch.empty(n, 16 + 2 * h, dtype=torch.uint8, device=device) for n in rows_from]
        pending = self._exchange.start("low_latency_combine", sends, recvs)

        def receive() -> None:
            self._add_wait(wait_stats, pending.wait())
            got = torch.cat([recv for recv in pending.recvs if recv is not None])
            ids = _from_bytes(got[:, :16], torch.int64)
            y = _from_bytes(got[:, 16:], torch.bfloat16)
            keys, order = torch.sort(ids[:, 0] * num_experts + ids[:, 1])
            num_tokens, top_k = topk_idx.shape
            # A masked rank's experts count as -1 (rank masking: their outputs never come).
            live = torch.tensor([not self._is_masked(r) for r in range(num_ranks)], device=device)
            valid = (topk_idx >= 0) & live[topk_idx.clamp_min(0) // num_local]  # [N, K]
            want = (torch.arange(num_tokens, device=device)[:, None] * num_experts + topk_idx)[valid]
            pos = torch.searchsorted(keys, want).clamp_max(max(len(keys) - 1, 0))
            if len(want) and (len(keys) == 0 or not bool((keys[pos] == want).all())):
                raise ValueError("topk_idx: does not match the dispatch that produced `handle` "
                                 "(a token's expert received no row)")
            row_of = torch.zeros(num_tokens, top_k, dtype=torch.int64, device=device)
            row_of[valid] = order[pos]  # where (token, k)'s expert output lies in y
            acc = torch.zeros(num_tokens, h, dtype=torch.float32, device=device)
            for k in range(top_k):  # ascending k, float32, rounded once at the end
                mine = valid[:, k]
                acc[mine] += topk_weights[mine, k:k + 1] * y[row_of[mine, k]].float()
            out.copy_(acc)

        return receive
