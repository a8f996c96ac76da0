"""Triton kernels for the expert GEMMs on dispatch's masked layout (GPU only).

One kernel does both GEMMs: a fixed grid of programs (two per SM) that read `recv_count` on the
device and share out the (row tile, column tile) items of the received rows only, so no host sync is
needed, the launch shape depends only on the GPU (CUDA-graph friendly) and an expert without rows costs
nothing (at decode most experts get few rows or none). Against one program per possible tile this made
the GEMMs of a DeepSeek-V3 layer 5 % faster (97 % of the copy bandwidth at 128 tokens; H200).
bf16, or FP8 e4m3 with per-token-per-128 activation scales and 128x128 block weight scales
(DeepGEMM's scheme: each 128-deep partial product is scaled, then accumulated in float32). The
gate_up GEMM computes gate and up tiles side by side and writes SiLU(gate) * up.

Importing this module needs neither Triton nor a GPU (the kernels are only defined when Triton
imports); `available()` says whether they can run.
"""

from __future__ import annotations

import functools

import torch

from ..backends.base import RowsInPlace
from ..block_fp8 import WEIGHT_BLOCK
from ..quant import FP8_GROUP
from . import triton_routing
from .experts import ExpertKernels, RecvX, check_rows_in_place, split_recv_x
from .routing import RoutingConfig
from .weights import ExpertWeights

try:
    import triton
    import triton.language as tl
except ImportError as error:  # no Triton in this install: the PyTorch path still works
    triton = None
    _IMPORT_ERROR: str | None = str(error)
else:
    _IMPORT_ERROR = None

BLOCK_M = 64  # rows (tokens) per program
BLOCK_N_GATED = 64  # gate_up: output columns per program (two accumulators: gate and up)
BLOCK_N = 128  # down: output columns per program
BLOCK_N_FEW_ROWS = 32  # dense FP8 linear with at most BLOCK_M rows: 4x the programs, each streams less weight
SPLITK_MAX_ROWS = 16  # dense FP8 linear with at most this many rows: split-K GEMM (one 16-row tile)
SPLITK_MIN_DEPTH = 4096  # dense FP8 linear this deep or deeper: split-K GEMM for up to BLOCK_M rows
SPLITK_BLOCK_N = 64
SPLITK_PROGRAMS_PER_SM = 2  # split K until the grid holds about this many programs per SM
# Outputs per program of the split-K parts' sum: the wide block where it still makes two programs per SM,
# else the narrow one (a decode step's sums are latency-bound: 1.3-1.6 against 1.4-2.6 us at one row, H200).
SUM_BLOCK, SUM_BLOCK_NARROW = 1024, 256
BLOCK_K_BF16 = 64
NUM_WARPS = 4
# Expert GEMM tiles in flight per program: four (96 KB of shared memory; two programs per SM leave 36 KB).
# Against three (H200, V3 shapes, 32 experts): gate_up 4-5 % faster from 1 to 32 rows per expert and 9 % at
# 256, down 2-8 %; the layer at EP = 8 (emulated) 2-2.5 % faster from 32 to 256 tokens per rank.
NUM_STAGES = 4
CAST_ROWS = 32  # rows per item of the FP8 cast (of the intermediate, and of dense layers' inputs)
CAST_PROGRAMS_PER_SM = 4  # the cast's fixed grid
# The expert GEMM's fixed grid: two programs per SM, each held to 224 registers per thread (it takes ~250
# unbounded). Two fill an SM but for 8K registers, where the combine's receive blocks still fit; a third
# program per SM would wait for one of the two. Measured on an H200 at DeepSeek-V3's shapes: the GEMMs 2-3 %
# faster than unbounded, 5 % faster than one program per tile; at 192 registers they spill and run 9 % slower.
GEMM_PROGRAMS_PER_SM = 2
GEMM_MAX_REGISTERS = 224


def available() -> bool:
    """True when Triton imports and torch sees a CUDA GPU."""
    return triton is not None and torch.cuda.is_available()


def unavailable_reason() -> str:
    if triton is None:
        return f"Triton does not import: {_IMPORT_ERROR}"
    return "torch sees no CUDA GPU" if not torch.cuda.is_available() else "available"


if triton is not None:

    @triton.jit
    def _masked_gemm_kernel(
            a_ptr, a_scale_ptr, a_rows_ptr, b_ptr, b_scale_ptr, out_ptr, count_ptr,
            E, N, K, UP_OFFSET,
            stride_ae, stride_am, stride_ak,
            stride_se, stride_sm, stride_sk,
            stride_re,
            stride_be, stride_bn, stride_bk,
            stride_te, stride_tn, stride_tk,
            stride_oe, stride_om, stride_on,
            FP8: tl.constexpr, GATED: tl.constexpr, ROWS_IN_PLACE: tl.constexpr, E_PAD: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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


    @triton.jit
    def _fp8_splitk_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, part_ptr, M, N, K_BLOCKS, SPLIT,
                           stride_am, stride_sm, stride_bn, stride_tn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Split-K FP8 GEMM for a decode step's rows: program (n, s, m) sums the 128-deep blocks s, s +
        SPLIT, ... of out[m tile, n tile] = a [M, K] . b [N, K]^T, each block scaled as in
        _masked_gemm_kernel, into part[s] (float32 [SPLIT, M, N]; _sum_parts_kernel adds them in order:
        deterministic). (Casting a here instead costs more than the cast's launch: every column tile would
        cast it.)"""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block in range(split, K_BLOCKS, SPLIT):
            k0 = block * BLOCK_K
            a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptr + cols[None, :] * stride_bn + (k0 + ks)[:, None], mask=col_ok[None, :], other=0.0)
            a_s = tl.load(a_scale_ptr + rows * stride_sm + block, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_tn + block)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        out = part_ptr + split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


    @triton.jit
    def _sum_parts_kernel(part_ptr, out_ptr, M, N, SPLIT: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr):
        """out [M, N] = bf16(part[0] + part[1] + ... + part[SPLIT - 1]), added in that order (float32).
        GATED: parts are [SPLIT, M, 2N], gate columns [0, N) and up columns [N, 2N), and out = SiLU(gate) *
        up as _masked_gemm_kernel computes it. The loop is unrolled (SPLIT is a constant), so that all
        parts' loads are in flight at once: a loop of dependent steps took 5.5 against 1.6 us for 30 parts
        of 576 columns (H200)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        width = 2 * N if GATED else N
        at = (offs // N) * width + offs % N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + s * M * width + at, mask=ok, other=0.0)
            if GATED:
                acc_up += tl.load(part_ptr + s * M * width + at + N, mask=ok, other=0.0)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=ok)


    @triton.jit
    def _divide(x, s):
        """x / s rounded as IEEE division rounds it (csrc/ll_dispatch.cu's `divide`, where the argument
        is made): q0 = RN(x * RN(1 / s)) is within an ulp, the remainder x - q0 * s is exact in one FMA,
        and q0 + remainder / s rounds correctly. One division per row instead of one per element (a
        division is a chain of a dozen instructions). The sign is copied back for x = -0; an infinite
        s (an infinite x in the group) gives q0, which is then x / s already."""
        r = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * r
        q = tl.fma(tl.fma(-s, q0, x), r, q0)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        q = ((q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
        return tl.where(s == float("inf"), q0, q)


    @triton.jit
    def _cast_rows_kernel(x_ptr, q_ptr, s_ptr, count_ptr, E, M, I, GROUPS, E_PAD: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr, ALL_ROWS: tl.constexpr):
        """FP8 cast of x [E, M, I] by [BLOCK_ROWS, 128] tiles (the design's rule, IEEE float32 divisions):
        scale = max(amax, 1e-4) / 448 per row and group, q = e4m3(x / scale), saturated. A fixed grid
        shares out the (row tile, group) items of the received rows only, numbered expert by expert (as
        the GEMM's), so no program exists for rows that were not received. ALL_ROWS: all M rows of every
        expert (count_ptr unused)."""
        experts = tl.arange(0, E_PAD)
        counts = tl.where(experts < E, M, 0) if ALL_ROWS else tl.load(count_ptr + experts, mask=experts < E, other=0)
        tiles = (counts + BLOCK_ROWS - 1) // BLOCK_ROWS
        ends = tl.cumsum(tiles, 0)  # row tiles of experts 0..e
        for item in range(tl.program_id(0), tl.sum(tiles) * GROUPS, tl.num_programs(0)):
            tile, group = item // GROUPS, item % GROUPS
            index = tl.sum((ends <= tile).to(tl.int32))  # the expert that `tile` belongs to
            mine = experts == index
            rows = (tile - tl.sum(tl.where(mine, ends - tiles, 0))) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            ok = rows < tl.sum(tl.where(mine, counts, 0))
            expert = index.to(tl.int64)
            cols = group * GROUP + tl.arange(0, GROUP)
            offs = expert * M * I + rows[:, None] * I + cols[None, :]
            x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
            scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            q = tl.clamp(_divide(x, scale[:, None]), -448.0, 448.0)
            tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=ok[:, None])
            tl.store(s_ptr + expert * M * GROUPS + rows * GROUPS + group, scale, mask=ok)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, which the kernels' fixed grids are sized by (asked once per device: the
    properties lookup costs microseconds of host time per launch)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def cast_rows_to_fp8(x: torch.Tensor, recv_count: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-per-128 FP8 cast of x [E, M, I] for rows below recv_count only (others untouched; None:
    all rows): (e4m3 [E, M, I], float32 scales [E, M, I/128])."""
    e, m, i = x.shape
    q = torch.empty(e, m, i, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(e, m, i // FP8_GROUP, dtype=torch.float32, device=x.device)
    groups = i // FP8_GROUP
    programs = min(CAST_PROGRAMS_PER_SM * sm_count(x.device), e * triton.cdiv(m, CAST_ROWS) * groups)
    _cast_rows_kernel[(max(1, programs),)](x, q, s, recv_count, e, m, i, groups, E_PAD=triton.next_power_of_2(e),
                                           BLOCK_ROWS=CAST_ROWS, GROUP=FP8_GROUP, ALL_ROWS=recv_count is None,
                                           num_warps=NUM_WARPS)
    return q, s


def masked_grouped_gemm(a: torch.Tensor | RowsInPlace, a_scales: torch.Tensor | None, b: torch.Tensor,
                        b_scales: torch.Tensor | None, recv_count: torch.Tensor, out: torch.Tensor,
                        up_offset: int = 0, gated: bool = False, block_n: int | None = None) -> torch.Tensor:
    """Launch the kernel: a [E, M, K] (bf16, or fp8 with a_scales [E, M, K/128]; or dispatch's rows in
    place, with their scales: a_scales None), b [E, rows, K] (with b_scales [E, rows/128, K/128] for FP8)
    into out bf16 [E, M, N]; rows >= recv_count[e] untouched.
    block_n: output columns per program (default BLOCK_N_GATED or BLOCK_N)."""
    if triton is None:
        raise RuntimeError(unavailable_reason())
    e, _, k = b.shape
    n = out.shape[2]
    in_place = isinstance(a, RowsInPlace)
    if in_place:
        a_scales = a.scales
    fp8 = a_scales is not None
    block_n = block_n or (BLOCK_N_GATED if gated else BLOCK_N)
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
    _masked_gemm_kernel[(GEMM_PROGRAMS_PER_SM * sm_count(out.device),)](
        a, a_s, a_rows, b, b_s, out, recv_count, e, n, k, up_offset,
        *a_st, *a_ss, r_s, *b.stride(), *b_ss, *out.stride(),
        FP8=fp8, GATED=gated, ROWS_IN_PLACE=in_place, E_PAD=triton.next_power_of_2(e), BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=GEMM_MAX_REGISTERS)
    return out


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight.T for an FP8 e4m3 weight [N, K] with 128x128 block scales [ceil(N/128), K/128]:
    x is cast per token and 128 channels as the experts' activations are, the GEMM is the masked one
    with a single group of M rows (no host sync). bf16 [M, N]. gated: weight holds gate rows then up
    rows (N = 2I, I a multiple of 128), and the result is SiLU(gate) * up, bf16 [M, I]."""
    m, k = x.shape
    if k % FP8_GROUP:
        raise ValueError(f"x: expected a multiple of {FP8_GROUP} input features for an FP8 weight, got {k}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated and (weight.shape[0] % 2 or n % WEIGHT_BLOCK):
        raise ValueError(f"weight: expected gate and up halves of a multiple of {WEIGHT_BLOCK} rows each, "
                         f"got {weight.shape[0]} rows")
    out = torch.empty(1, m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out[0]
    data, scales = cast_rows_to_fp8(x.contiguous()[None], None)  # all m rows: no count to fill first
    # A decode step's few rows make one row tile: narrow column tiles spread the weight over more SMs
    # (at 128 columns a 576- or 7168-wide projection ran on 5 or 56 programs; measured on an H200). Where
    # even those tiles are fewer than the SMs, K is split as well; and for a deep projection in one row
    # tile, where each narrow tile would stream all of K alone (H200, 32 rows: o_proj 16384 -> 7168 47
    # against 64 us; the 2048-deep down projection 8.2 against 6.6 us, so it stays masked). The shared
    # expert's gated gate_up on split-K: its whole MLP 45 -> 24 us at 1 row, 53 -> 44 us at 128 (H = 7168).
    # The gated GEMM keeps its own column tile (two accumulators: wider tiles spill).
    block_n = BLOCK_N_GATED if gated else BLOCK_N_FEW_ROWS if m <= BLOCK_M else BLOCK_N
    deep = m <= BLOCK_M and k >= SPLITK_MIN_DEPTH
    if m <= SPLITK_MAX_ROWS or deep or _fewer_tiles_than_sms(m, n, block_n, x.device):
        return _fp8_splitk_linear(data[0], scales[0], weight, weight_scale_inv, out[0], gated)
    count = torch.full((1,), m, dtype=torch.int32, device=x.device)  # one expert's m rows
    return masked_grouped_gemm(data, scales, weight[None], weight_scale_inv[None], count, out,
                               up_offset=n if gated else 0, gated=gated, block_n=block_n)[0]


def _fewer_tiles_than_sms(rows: int, columns: int, block_n: int, device: torch.device) -> bool:
    """Whether one expert's [rows, columns] output makes fewer masked-GEMM tiles than the GPU has SMs: then
    the split-K GEMM is the faster (H200: dense projections and the shared expert at decode sizes)."""
    return triton.cdiv(columns, block_n) * triton.cdiv(rows, BLOCK_M) < sm_count(device)


def _fp8_splitk_linear(data: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                       weight_scale_inv: torch.Tensor, out: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """The split-K path of fp8_block_linear, into out bf16 [M, N]: a decode step's few rows give too few
    tiles to fill the GPU, so the 128-deep blocks of K are spread over programs as well; a second launch
    adds the parts and rounds to bf16. gated: weight [2N, K] holds gate rows then up rows, and out gets
    SiLU(gate) * up."""
    m, k = data.shape
    n = weight.shape[0]
    k_blocks = k // FP8_GROUP
    block_m = SPLITK_MAX_ROWS if m <= SPLITK_MAX_ROWS else BLOCK_M
    tiles = triton.cdiv(n, SPLITK_BLOCK_N) * triton.cdiv(m, block_m)
    split = max(1, min(k_blocks, triton.cdiv(SPLITK_PROGRAMS_PER_SM * sm_count(data.device), tiles)))
    parts = torch.empty(split, m, n, dtype=torch.float32, device=data.device)
    _fp8_splitk_kernel[(triton.cdiv(n, SPLITK_BLOCK_N), split, triton.cdiv(m, block_m))](
        data, scales, weight, weight_scale_inv, parts, m, n, k_blocks, split,
        data.stride(0), scales.stride(0), weight.stride(0), weight_scale_inv.stride(0),
        BLOCK_M=block_m, BLOCK_N=SPLITK_BLOCK_N, BLOCK_K=FP8_GROUP, num_warps=NUM_WARPS)
    block = SUM_BLOCK if triton.cdiv(out.numel(), SUM_BLOCK) >= 2 * sm_count(out.device) else SUM_BLOCK_NARROW
    _sum_parts_kernel[(triton.cdiv(out.numel(), block),)](parts, out, m, out.shape[1], SPLIT=split, GATED=gated,
                                                          BLOCK=block, num_warps=NUM_WARPS)
    return out


def _bf16_one_expert(x: torch.Tensor, weight: torch.Tensor, columns: int, gated: bool = False) -> torch.Tensor:
    """x bf16 [M, K] through one expert's bf16 weight [1, rows, K] on the masked GEMM: bf16 [M, columns]
    (gated: gate rows [0, columns), up rows from `columns`, and SiLU(gate) * up)."""
    m = x.shape[0]
    out = torch.empty(m, columns, dtype=torch.bfloat16, device=x.device)
    if m > 0:
        count = torch.full((1,), m, dtype=torch.int32, device=x.device)
        masked_grouped_gemm(x[None], None, weight, None, count, out[None], up_offset=columns if gated else 0,
                            gated=gated)
    return out


class TritonExperts(ExpertKernels):
    """The expert MLP in two kernel launches (gate_up with SiLU * up, then down), plus the FP8 cast of
    the intermediate activation between them for FP8 weights. No host sync. The shared experts' MLP
    (dense_gate_up, dense_down) takes the split-K GEMM at decode sizes."""

    name = "triton"
    reads_rows_in_place = True

    def __call__(self, x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, RowsInPlace):  # the GEMM reads the rows where dispatch left them
            e, m = check_rows_in_place(x, recv_count, weights)
            a, a_scales, device = x, None, recv_count.device
        else:
            a, a_scales = split_recv_x(x, recv_count, weights)
            (e, m, _), device = a.shape, a.device
        h, i = weights.hidden, weights.padded_intermediate
        if out is None:
            out = torch.empty(e, m, h, dtype=torch.bfloat16, device=device)
        if m == 0:
            return out
        act = torch.empty(e, m, i, dtype=torch.bfloat16, device=device)
        masked_grouped_gemm(a, a_scales, weights.gate_up, weights.gate_up_scale, recv_count, act,
                            up_offset=i, gated=True)
        act_scales = None
        if weights.fp8:  # only received rows are cast; the down GEMM never reads the others
            act, act_scales = cast_rows_to_fp8(act, recv_count)
        return masked_grouped_gemm(act, act_scales, weights.down, weights.down_scale, recv_count, out)

    def route(self, hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
              config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        # The selection in one launch, not a dozen; a decode step's few tokens' logits in a GEMV, not cuBLAS.
        return triton_routing.route(hidden_states, gate_weight, e_score_correction_bias, config)

    def dense_gate_up(self, x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        if weights.fp8:  # it picks its GEMM: split-K at decode sizes (SiLU(gate) * up in the parts' sum)
            return fp8_block_linear(x, weights.gate_up[0], weights.gate_up_scale[0], gated=True)
        return _bf16_one_expert(x, weights.gate_up, weights.padded_intermediate, gated=True)

    def dense_down(self, act: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        if weights.fp8:
            return fp8_block_linear(act, weights.down[0], weights.down_scale[0])  # it picks its GEMM
        return _bf16_one_expert(act, weights.down, weights.hidden)

    def cast_to_fp8(self, x: torch.Tensor, recv_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cast_rows_to_fp8(x.contiguous(), recv_count)  # one launch (the PyTorch cast takes eight)
