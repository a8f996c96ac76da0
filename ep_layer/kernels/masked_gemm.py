"""The grouped GEMM on dispatch's masked layout, in Triton (GPU only): out[e, m] = a[e, m] . b[e]^T for
the rows m < count[e] of each group e. It is the MoE layer's expert GEMM (ep_layer.moe.triton_experts),
and with a single group the dense FP8 linear's GEMM for larger batches (fp8_linear).

A fixed grid of programs (two per SM) reads the counts on the device and shares out the (row tile,
column tile) items of the received rows only, so no host sync is needed, the launch shape depends only
on the GPU (CUDA-graph friendly) and a group without rows costs nothing (at decode most experts get few
rows or none); the fixed grid beat one program per possible tile (benchmarks/RESULTS.md, bench_moe.py).
bf16, or FP8 e4m3 with per-token-per-128 activation scales and 128x128 block weight scales (DeepGEMM's
scheme: each 128-deep partial product is scaled, then accumulated in float32). The gated GEMM computes
gate and up tiles side by side and writes SiLU(gate) * up.
"""

from __future__ import annotations

import torch

from ..backends.base import RowsInPlace, SendSignals
from ..block_fp8 import WEIGHT_BLOCK
from .launch import Launcher, cdiv, next_power_of_2
from .triton_support import sm_count, tl, triton, unavailable_reason

BLOCK_M = 64  # rows (tokens) per program
BLOCK_N_GATED = 64  # gated: output columns per program (two accumulators: gate and up)
BLOCK_N = 128  # not gated: output columns per program
BLOCK_K_BF16 = 64
NUM_WARPS = 4
# Tiles in flight per program: four (96 KB of shared memory; two programs per SM leave 36 KB), faster
# than three (benchmarks/RESULTS.md, bench_moe.py).
NUM_STAGES = 4
# The fixed grid: two programs per SM, each held to 224 registers per thread (it takes ~250 unbounded).
# Two fill an SM but for 8K registers, where the combine's receive blocks still fit; a third program per
# SM would wait for one of the two, and at 192 registers they spill (benchmarks/RESULTS.md, bench_moe.py).
GEMM_PROGRAMS_PER_SM = 2
GEMM_MAX_REGISTERS = 224

if triton is not None:

    @Launcher
    @triton.jit
    def _masked_gemm_kernel(
            a_ptr, a_scale_ptr, a_rows_ptr, b_ptr, b_scale_ptr, out_ptr, count_ptr, signal_ptr,
            E, N, K, UP_OFFSET, SIGNALS_PER_EXPERT,
            stride_ae, stride_am, stride_ak,
            stride_se, stride_sm, stride_sk,
            stride_re,
            stride_be, stride_bn, stride_bk,
            stride_te, stride_tn, stride_tk,
            stride_oe, stride_om, stride_on,
            FP8: tl.constexpr, GATED: tl.constexpr, ROWS_IN_PLACE: tl.constexpr, SIGNAL: tl.constexpr,
            E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[e, m, n] = sum_k a[e, m, k] * b[e, n, k] for m < count[e] (bf16 out, float32 accumulation).

        The (row tile, column tile) items of all experts' received rows go to programs pid, pid + grid, ...,
        numbered expert by expert, and within one by column tile, then row tile: an expert with several row
        tiles has them computed side by side, so that its weight tile is read from HBM once and from L2
        after (its rows, 64 x 7168 bytes per tile, stay in L2 across its column tiles).
        GATED: b holds gate rows [0, N) and up rows [UP_OFFSET, UP_OFFSET + N); out = SiLU(gate) * up.
        FP8: a_scale [e, m, k / 128] per token and 128 channels, b_scale [e, n / 128, k / 128] per block;
        BLOCK_K is 128 and BLOCK_N divides 128, so each tile step uses one scale of each kind.
        ROWS_IN_PLACE: row m of expert e is where dispatch left it (ep_layer.RowsInPlace): its K values at
        byte offset a_rows[e, m] from a_ptr (the scales are packed as without it).
        SIGNAL: each finished item adds 1 to signal[e * SIGNALS_PER_EXPERT + its row tile], after its
        stores and with release semantics, so a reader that sees the count at the number of column tiles
        (with acquire) sees the rows of that tile (single-batch overlap: the combine sends them).
        """
        experts = tl.arange(0, E_PAD)
        counts = tl.load(count_ptr + experts, mask=experts < E, other=0)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        col_tiles = tl.cdiv(N, BLOCK_N)
        ends = tl.cumsum(tiles * col_tiles, 0)  # items of experts 0..e
        ks = tl.arange(0, BLOCK_K)
        for item in range(tl.program_id(0), tl.sum(tiles) * col_tiles, tl.num_programs(0)):
            index = tl.sum((ends <= item).to(tl.int32))  # the expert that `item` belongs to
            mine = experts == index
            local = item - tl.sum(tl.where(mine, ends - tiles * col_tiles, 0))
            row_tiles = tl.sum(tl.where(mine, tiles, 0))
            rows = (local % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < tl.sum(tl.where(mine, counts, 0))
            pid_n = local // row_tiles
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            expert = index.to(tl.int64)
            if ROWS_IN_PLACE:
                at = tl.load(a_rows_ptr + expert * stride_re + rows, mask=row_ok, other=0)  # on 128-byte lines
                a_row = tl.multiple_of(at, 16) if FP8 else tl.multiple_of(at // 2, 8)
            else:
                a_row = expert * stride_ae + rows * stride_am
            a_ptrs = a_ptr + a_row[:, None] + ks[None, :] * stride_ak
            b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + ks < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if GATED:
                    b_up = tl.load(b_ptrs + UP_OFFSET * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if FP8:
                    block = k0 // BLOCK_K
                    a_s = tl.load(a_scale_ptr + expert * stride_se + rows * stride_sm + block * stride_sk,
                                  mask=row_ok, other=0.0)
                    t_ptr = b_scale_ptr + expert * stride_te + block * stride_tk
                    b_s = tl.load(t_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_tn)
                    acc += tl.dot(a, b) * (a_s[:, None] * b_s)
                    if GATED:
                        up_s = tl.load(t_ptr + ((pid_n * BLOCK_N + UP_OFFSET) // BLOCK_K) * stride_tn)
                        acc_up += tl.dot(a, b_up) * (a_s[:, None] * up_s)
                else:
                    acc = tl.dot(a, b, acc)
                    if GATED:
                        acc_up = tl.dot(a, b_up, acc_up)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if GATED:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            out_ptrs = out_ptr + expert * stride_oe + rows[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])
            if SIGNAL:
                tl.debug_barrier()  # every thread's stores of the tile come before the release below
                tl.atomic_add(signal_ptr + expert * SIGNALS_PER_EXPERT + local % row_tiles, 1, sem="release",
                              scope="gpu")


def completion_signals(num_experts: int, rows: int, columns: int, device: torch.device) -> SendSignals:
    """Zeroed signals for masked_grouped_gemm(..., signals=) on out [num_experts, rows, columns] (not gated,
    BLOCK_N columns per program): one per BLOCK_M rows of an expert, complete at its number of column tiles."""
    per_expert = max(cdiv(rows, BLOCK_M), 1)
    return SendSignals(torch.zeros(num_experts * per_expert, dtype=torch.int32, device=device), BLOCK_M, per_expert,
                       cdiv(columns, BLOCK_N))


def masked_grouped_gemm(a: torch.Tensor | RowsInPlace, a_scales: torch.Tensor | None, b: torch.Tensor,
                        b_scales: torch.Tensor | None, recv_count: torch.Tensor, out: torch.Tensor,
                        up_offset: int = 0, gated: bool = False, block_n: int | None = None,
                        signals: SendSignals | None = None, spare_sms: int = 0) -> torch.Tensor:
    """Launch the kernel: a [E, M, K] (bf16, or fp8 with a_scales [E, M, K/128]; or dispatch's rows in
    place, with their scales: a_scales None), b [E, rows, K] (with b_scales [E, rows/128, K/128] for FP8)
    into out bf16 [E, M, N]; rows >= recv_count[e] untouched.
    block_n: output columns per program (default BLOCK_N_GATED or BLOCK_N).
    signals: completion_signals(E, M, N) for this call, counted per finished tile (not gated only).
    spare_sms: SMs the grid leaves free for a kernel that runs beside it and waits for these signals (the held
    send of single-batch overlap). Beside that send a full grid ran hundreds of µs slower: some programs start
    only as others finish, and the GEMM's work is shared out in advance (benchmarks/RESULTS.md)."""
    if triton is None:
        raise RuntimeError(unavailable_reason())
    e, _, k = b.shape
    n = out.shape[2]
    in_place = isinstance(a, RowsInPlace)
    if in_place:
        a_scales = a.scales
    fp8 = a_scales is not None
    block_n = block_n or (BLOCK_N_GATED if gated else BLOCK_N)
    if signals is not None and (gated or block_n != BLOCK_N or signals.rows != BLOCK_M
                                or signals.threshold != cdiv(n, BLOCK_N)):
        raise ValueError("masked_grouped_gemm: signals must come from completion_signals for this output, "
                         "on a GEMM that is not gated, at the default column tile")
    block_k = WEIGHT_BLOCK if fp8 else BLOCK_K_BF16
    if fp8 and (b_scales is None or WEIGHT_BLOCK % block_n or up_offset % WEIGHT_BLOCK):
        raise ValueError("masked_grouped_gemm: FP8 needs block scales for b, column tiles that divide 128 "
                         "and an up offset on a 128-row block")
    if in_place:  # one base address: the rows' offsets say where each row lies
        a_rows, r_s = a.offsets, a.offsets.stride(0)
        a, a_st = a.base.view(torch.float8_e4m3fn if fp8 else torch.bfloat16), (0, 0, 1)
    else:
        a_rows, r_s, a_st = a, 0, a.stride()  # a_rows not read
    a_s = a_scales if a_scales is not None else a  # never read without FP8
    a_ss = a_scales.stride() if a_scales is not None else (0, 0, 0)
    b_s = b_scales if b_scales is not None else b
    b_ss = b_scales.stride() if b_scales is not None else (0, 0, 0)
    sms = sm_count(out.device)
    if not 0 <= spare_sms < sms:
        raise ValueError(f"masked_grouped_gemm: spare_sms must be in [0, {sms}), got {spare_sms}")
    _masked_gemm_kernel[(GEMM_PROGRAMS_PER_SM * (sms - spare_sms),)](
        a, a_s, a_rows, b, b_s, out, recv_count, signals.signals if signals is not None else recv_count, e, n, k,
        up_offset, signals.per_expert if signals is not None else 0,
        *a_st, *a_ss, r_s, *b.stride(), *b_ss, *out.stride(),
        FP8=fp8, GATED=gated, ROWS_IN_PLACE=in_place, SIGNAL=signals is not None, E_PAD=next_power_of_2(e),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        maxnreg=GEMM_MAX_REGISTERS)
    return out
