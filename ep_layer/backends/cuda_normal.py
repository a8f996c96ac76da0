"""The cuda backend's normal (high-throughput) mode: DeepEP's `dispatch` and `combine` over a second
buffer per rank (`num_nvl_bytes`) that every peer maps through CUDA IPC or NVSHMEM (csrc/normal.cuh says
how).

A call stages this rank's rows in its own buffer, exchanges flags with every peer and pulls the rows
meant for it from the peers' buffers (with NVSHMEM gets from a peer without a load/store path), in the
order and with the arithmetic of the reference backend (reference_normal.py), so the results agree bit
for bit. A combine's rows may be written where the
combine stages them (`combine_buffer`), which saves that copy. A dispatch whose outputs are not sized by
`num_worst_tokens` or a handle waits for the host once, for the number of rows it receives; the
argument checks that need the device ride on that wait. Waits for peers are bounded by `timeout_s`;
failures inside the kernels are recorded on the device and raised at the next call or at `check()`.
"""

from __future__ import annotations

import math

import torch

from .. import layout
from ..checks import check_topk_values, expect
from ..dispatch_layout import dispatch_layout
from ..errors import EPTimeoutError
from ..kernel_args import NormalPointers
from ..layout import STAGE_HEADER_BYTES, normal_buffer_bytes, normal_half_bytes, row_stride, stage_bytes
from .device_errors import take_recorded_error
from .device_tensor import device_tensor
from .normal import NormalCombineArgs, NormalDispatchArgs, NormalDispatchResult, NormalHandle

_DISPATCH, _CACHED_DISPATCH, _COMBINE = 0, 1, 2  # NormalOp
_ERROR_OPS = {2: "dispatch", 3: "combine"}
_TIMEOUT, _MISMATCH, _BAD_HANDLE, _TOO_MANY_ROWS = 1, 2, 4, 5
_NO_POINTERS = NormalPointers(*[0] * len(NormalPointers._fields))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and starting on 16 bytes, as the kernels read it."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def _load_torch_kernels(num_ranks: int, device: torch.device) -> None:
    """Runs the torch ops of the calls' host side once: under CUDA's lazy loading a kernel's first launch
    waits for the device, where an emulated rank's exchange may be waiting for ranks launched after it."""
    in_rank = torch.zeros(2, num_ranks, dtype=torch.bool, device=device)
    in_rank.sum(dim=0, dtype=torch.int32)
    (in_rank.cumsum(dim=0, dtype=torch.int32) - 1).contiguous()
    torch.cuda.synchronize(device)


class CudaNormalMode:
    """Normal-mode dispatch and combine of one rank, over its normal-mode buffer and its peers'."""

    def __init__(self, c: object, rank: int, num_ranks: int, bases: list[int], num_bytes: int,
                 system_scope: bool, timeout_s: float, device: torch.device, *, emulated: bool, max_sms: int,
                 get_ranks: int = 0, landing: int = 0) -> None:
        """`emulated`: the ranks run in this process (their dispatches must not wait for the host);
        `max_sms`: this rank's share of the GPU, the most SMs a call's kernels take whatever Config says;
        `get_ranks` (bit r): the ranks read with NVSHMEM gets, through the landing area at `landing`."""
        self._c, self.rank, self.num_ranks, self.timeout_s = c, rank, num_ranks, timeout_s
        self._emulated, self._max_sms, self._get_ranks = emulated, max_sms, get_ranks
        self._base, self._num_bytes, self._device = bases[rank], num_bytes, device
        self._half = normal_half_bytes(num_bytes)
        expect(self._half > STAGE_HEADER_BYTES, "num_nvl_bytes", f"more than "
               f"{normal_buffer_bytes(STAGE_HEADER_BYTES)} bytes (Config.get_nvl_buffer_size_hint)", num_bytes)
        c.normal_load_kernels()  # before any rank's exchange kernel can wait on the device
        if emulated:
            _load_torch_kernels(num_ranks, device)
        self._combine_rows = self._base + layout.normal_combine_rows_offset(num_bytes)  # in half 1 (normal.cuh)
        self._lent = False  # a view is out whose rows no combine has read yet
        self._host_flag, device_flag = c.alloc_host_flag()
        with torch.inference_mode(False):
            self._ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self._common = c.make_normal_common(c.NormalCommonArgs(
            rank=rank, num_ranks=num_ranks, system_scope=system_scope, peer_bases=bases, local_base=self._base,
            half_bytes=self._half, host_error=device_flag, timeout_s=timeout_s, ticket=self._ticket.data_ptr(),
            get_ranks=get_ranks, landing=landing))

    def _stream(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self._device.index)

    def _check_capacity(self, op: str, rows: int, stride: int, after_bytes: int) -> None:
        need = stage_bytes(rows, stride, after_bytes)
        expect(need <= self._half, "num_nvl_bytes", f"at least {normal_buffer_bytes(need)} "
               f"for a {op} of {rows} rows of {stride} bytes (two halves of {need} bytes)", self._num_bytes)

    # ------------------------------------------------------------------ errors
    def raise_recorded(self) -> None:
        """Raise what a kernel recorded; the host-mapped flag makes the no-error case free."""
        record = take_recorded_error(self._c, self._base, self._host_flag)
        if record is None:
            return
        code, op, mask, detail = record
        what = _ERROR_OPS.get(op, "normal mode")
        ranks = [r for r in range(self.num_ranks) if mask >> r & 1]
        if code == _TIMEOUT:
            raise EPTimeoutError(what, ranks, self.timeout_s, self.rank)
        if code == _MISMATCH:
            raise ValueError(f"{what}: rank(s) {ranks} made another call (dispatch, cached dispatch or combine), or "
                             f"sent other columns (x, scales, top-k ids, weights) or num_experts than rank {self.rank}")
        if code == _BAD_HANDLE:
            raise ValueError("handle: expected a handle of this group's dispatch (the ranks' counts differ from it)")
        if code == _TOO_MANY_ROWS:
            raise ValueError(f"num_worst_tokens: expected at least the {detail} tokens rank {self.rank} receives")
        raise RuntimeError(f"{what}: the kernels recorded error code {code}")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, args: NormalDispatchArgs) -> NormalDispatchResult:
        self.raise_recorded()
        c, r, stream, num_sms = self._c, self.num_ranks, self._stream(), min(args.num_sms, self._max_sms)
        expect(not self._emulated or args.cached is not None or args.num_worst_tokens > 0, "num_worst_tokens",
               "> 0 (or a handle) for ranks emulated in one process: a dispatch that waits for the host to count "
               "its rows would wait for ranks not yet launched", args.num_worst_tokens)
        columns = [_aligned(t) for t in args.columns]
        x, scales = columns[0], (columns[1] if len(columns) == 2 else None)
        num_tokens = x.shape[0]
        x_bytes = x.shape[1] * x.element_size()
        scale_bytes = 0 if scales is None else math.prod(scales.shape[1:]) * scales.element_size()
        topk_idx = None if args.topk_idx is None else _aligned(args.topk_idx)
        topk_weights = None if args.topk_weights is None else _aligned(args.topk_weights)
        k = 0 if topk_idx is None else topk_idx.shape[1]
        stride = row_stride(x_bytes, scale_bytes, 8 * k, 4 * k if topk_weights is not None else 0)
        self._check_capacity("dispatch", num_tokens, stride, r)
        expect(not self._get_ranks or stride - row_stride(x_bytes, 0, 0, 0) <= layout.NORMAL_WARP_LANDING_BYTES,
               "x", f"scales of at most {layout.NORMAL_WARP_LANDING_BYTES - 8 * k - 4 * k} bytes per token with ranks "
               "read by NVSHMEM gets (a row's columns after its data are fetched in one piece)", f"{scale_bytes} bytes")
        cached = args.cached
        in_rank = _aligned(args.is_token_in_rank)
        rows_to_rank = in_rank.sum(dim=0, dtype=torch.int32)
        num_experts = args.num_experts
        num_local = num_experts // r
        meta = torch.empty(2 + r + num_local, dtype=torch.int32, device=self._device)
        prefix = None if cached is not None else torch.empty((r, r), dtype=torch.int32, device=self._device)
        tokens_per_expert = None if cached is not None else _aligned(args.num_tokens_per_expert.to(torch.int32))
        op = _DISPATCH if cached is None else _CACHED_DISPATCH

        def shape(out_rows: int) -> object:
            return c.NormalShape(op=op, num_rows=num_tokens, x_bytes=x_bytes, scale_bytes=scale_bytes, num_topk=k,
                                 has_idx=topk_idx is not None, has_weights=topk_weights is not None,
                                 num_experts=num_experts, out_rows=out_rows, num_tokens=num_tokens,
                                 rows_in_place=False)

        def pointers(**outputs: int) -> tuple:
            return tuple(_NO_POINTERS._replace(
                x=x.data_ptr(), scales=_ptr(scales), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
                in_rank=in_rank.data_ptr(), rows_to_rank=rows_to_rank.data_ptr(),
                tokens_per_expert=_ptr(tokens_per_expert), meta=meta.data_ptr(), rank_prefix=_ptr(prefix),
                expected_prefix=_ptr(cached.rank_prefix_matrix) if cached is not None else 0, **outputs))

        stage = shape(0)
        c.normal_stage(self._common, stage, pointers(), num_sms, stream)
        c.normal_exchange(self._common, stage, pointers(), stream)
        per_expert = None
        if cached is not None:
            out_rows = cached.recv_src_idx.shape[0]
            src_idx, src_rank = cached.recv_src_idx, cached.recv_src_rank
        else:
            if args.num_worst_tokens:
                out_rows = args.num_worst_tokens
            else:  # the one wait for the host: the rows received size the outputs
                try:
                    out_rows, per_expert = self._received(args, meta, rows_to_rank, num_local)
                except Exception:  # a gather of no rows still releases the peers' halves this call staged
                    c.normal_gather(self._common, shape(0), pointers(), num_sms, stream)
                    raise
            src_idx = torch.empty(out_rows, dtype=torch.int32, device=self._device)
            src_rank = torch.empty(out_rows, dtype=torch.int32, device=self._device)
        out_x = torch.empty((out_rows, x.shape[1]), dtype=x.dtype, device=self._device)
        out_scales = None if scales is None else torch.empty((out_rows, *scales.shape[1:]), dtype=scales.dtype,
                                                             device=self._device)
        out_idx = None if topk_idx is None else torch.empty((out_rows, k), dtype=torch.int64, device=self._device)
        out_w = None if topk_weights is None else torch.empty((out_rows, k), dtype=torch.float32, device=self._device)
        gather = pointers(src_idx=src_idx.data_ptr(), src_rank=src_rank.data_ptr(), out_x=out_x.data_ptr(),
                          out_scales=_ptr(out_scales), out_topk_idx=_ptr(out_idx), out_weights=_ptr(out_w))
        if cached is None:
            c.normal_scan(self._common, shape(out_rows), gather, stream)
        c.normal_gather(self._common, shape(out_rows), gather, num_sms, stream)
        out_columns = (out_x,) if out_scales is None else (out_x, out_scales)
        handle = cached if cached is not None else NormalHandle(prefix, src_idx, src_rank, args.is_token_in_rank, k)
        return NormalDispatchResult(out_columns, out_idx, out_w, per_expert, handle)

    def _received(self, args: NormalDispatchArgs, meta: torch.Tensor, rows_to_rank: torch.Tensor,
                  num_local: int) -> tuple[int, list[int]]:
        """Wait for the exchange: (rows this rank receives, rows per local expert). The checks of this
        rank's counts and ids against its is_token_in_rank and topk_idx come back in the same copy."""
        e, idx = args.num_experts, args.topk_idx
        bad = [(args.num_tokens_per_rank.to(torch.int32) != rows_to_rank).any()]
        per_expert = None
        if idx is not None:
            _, per_expert, _ = dispatch_layout(idx, e, self.num_ranks)
            bad += [(per_expert != args.num_tokens_per_expert.to(torch.int32)).any(), ((idx < -1) | (idx >= e)).any()]
        host = torch.cat([meta, torch.stack(bad).to(torch.int32)]).tolist()
        self.raise_recorded()
        checks = host[len(host) - len(bad):]
        if idx is not None and checks[2]:
            check_topk_values(idx, e)
        if checks[0]:  # the values are read only for the message: a read is a host wait
            expect(False, "num_tokens_per_rank", f"the number of tokens is_token_in_rank sends each rank "
                   f"({rows_to_rank.tolist()})", args.num_tokens_per_rank.tolist())
        if idx is not None and checks[1]:
            expect(False, "num_tokens_per_expert", f"the number of tokens each expert has in topk_idx "
                   f"({per_expert.tolist()})", args.num_tokens_per_expert.tolist())
        r = self.num_ranks
        return host[1], host[2 + r:2 + r + num_local]

    # ------------------------------------------------------------------ combine
    def combine(self, args: NormalCombineArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.raise_recorded()
        c, r, stream, num_sms = self._c, self.num_ranks, self._stream(), min(args.num_sms, self._max_sms)
        handle = args.handle
        x = _aligned(args.x)
        rows, hidden = x.shape
        expect(hidden % 8 == 0, "x", "rows of a multiple of 8 values (16 bytes) for the cuda backend", hidden)
        weights = None if args.topk_weights is None else _aligned(args.topk_weights)
        k = 0 if weights is None else weights.shape[1]
        self._check_capacity("combine", rows, 2 * hidden, 4 * k)
        in_place = x.data_ptr() == self._combine_rows
        expect(in_place or not self._lent, "x", "the tensor get_next_combine_buffer returned: the rows written "
               "there wait for their combine, and a combine of other rows would overwrite them", "another tensor")
        self._lent = False
        in_rank = _aligned(handle.is_token_in_rank)
        num_tokens = in_rank.shape[0]
        send_pos = (in_rank.cumsum(dim=0, dtype=torch.int32) - 1).contiguous()  # [T, R]
        biases = [_aligned(b) for b in args.bias] + [None, None]
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self._device)
        combined_weights = None if k == 0 else torch.empty((num_tokens, k), dtype=torch.float32, device=self._device)
        meta = torch.empty(2 + r, dtype=torch.int32, device=self._device)
        shape = c.NormalShape(op=_COMBINE, num_rows=rows, x_bytes=2 * hidden, scale_bytes=0, num_topk=k,
                              has_idx=False, has_weights=weights is not None, num_experts=0, out_rows=0,
                              num_tokens=num_tokens, rows_in_place=in_place)
        prefix = _aligned(handle.rank_prefix_matrix)
        pointers = tuple(_NO_POINTERS._replace(
            x=x.data_ptr(), topk_weights=_ptr(weights), in_rank=in_rank.data_ptr(), meta=meta.data_ptr(),
            rank_prefix=prefix.data_ptr(), send_pos=send_pos.data_ptr(), src_rank=handle.recv_src_rank.data_ptr(),
            out=out.data_ptr(), bias0=_ptr(biases[0]), bias1=_ptr(biases[1]),
            combined_weights=_ptr(combined_weights)))
        c.normal_stage(self._common, shape, pointers, num_sms, stream)
        c.normal_exchange(self._common, shape, pointers, stream)
        c.normal_reduce(self._common, shape, pointers, num_sms, stream)
        return out, combined_weights

    def combine_buffer(self, rows: int, hidden: int) -> torch.Tensor:
        """bf16 [rows, hidden] where this rank's next combine stages its rows, once every peer has read
        those of the previous combine (a wait on the current stream, before the caller writes there)."""
        expect(hidden % 8 == 0, "hidden", "a multiple of 8 values (16 bytes) for the cuda backend", hidden)
        self._check_capacity("combine", rows, 2 * hidden, 0)
        self.raise_recorded()
        self._c.normal_wait_combine_half(self._common, self._stream())
        self._lent = True
        return device_tensor(self._combine_rows, (rows, hidden), self._device)  # not kept: N changes every call

    def destroy(self) -> None:
        self._c.free_host_flag(self._host_flag)
