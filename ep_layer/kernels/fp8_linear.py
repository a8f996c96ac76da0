"""The dense linear x @ weight.T for a 128x128 block-FP8 weight, in Triton (GPU only): DeepSeek-V3's
inference scheme (x cast per token and 128 channels, block-scaled products accumulated in float32), for
the serving model's FP8 projections and the MoE layer's shared experts. A decode step's few rows take a
split-K GEMM whose float32 parts a second launch adds in order (deterministic); larger batches take the
masked GEMM with a single group (masked_gemm).
"""

from __future__ import annotations

import torch

from ..block_fp8 import WEIGHT_BLOCK
from ..quant import AMAX_FLOOR, FP8_GROUP, FP8_MAX
from .fp8_cast import cast_rows_to_fp8
from .launch import Launcher, cdiv
from .masked_gemm import BLOCK_M, BLOCK_N, BLOCK_N_GATED, masked_grouped_gemm
from .triton_support import sm_count, tl, triton

BLOCK_N_FEW_ROWS = 32  # at most BLOCK_M rows on the masked GEMM: 4x the programs, each streams less weight
SPLITK_MAX_ROWS = 16  # at most this many rows: split-K GEMM (one 16-row tile)
SPLITK_MIN_DEPTH = 4096  # this deep or deeper: split-K GEMM for up to BLOCK_M rows
# The split-K GEMM's tunables (benchmarks/bench_linears.py --sweep times others).
SPLITK_BLOCK_N = 64
SPLITK_PROGRAMS_PER_SM = 2  # split K until the grid holds about this many programs per SM
SPLITK_WARPS = 4
SPLITK_STAGES = 3  # Triton's default
# Outputs per program of the split-K parts' sum: the wide block where it still makes two programs per SM,
# else the narrow one (a decode step's sums are bound by latency; benchmarks/RESULTS.md, profile_decode.py).
SUM_BLOCK, SUM_BLOCK_NARROW = 1024, 256
NUM_WARPS = 4
FP8Rows = tuple[torch.Tensor, torch.Tensor]  # rows cast per token and 128 channels: e4m3 [M, K], float32 [M, K/128]

if triton is not None:
    from .fp8_cast import divide_as_ieee

    @Launcher
    @triton.jit
    def _fp8_splitk_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, part_ptr, M, N, K_BLOCKS, SPLIT,
                           stride_am, stride_sm, stride_bn, stride_tn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Split-K FP8 GEMM for a decode step's rows: program (n, s, m) sums the 128-deep blocks s, s +
        SPLIT, ... of out[m tile, n tile] = a [M, K] . b [N, K]^T, each block scaled as in the masked
        GEMM, into part[s] (float32 [SPLIT, M, N]; _sum_parts_kernel adds them in order:
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


    @Launcher
    @triton.jit
    def _sum_parts_kernel(part_ptr, out_ptr, scale_ptr, M, N, SPLIT: tl.constexpr, GATED: tl.constexpr,
                          CAST: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, FLOOR: tl.constexpr,
                          LARGEST: tl.constexpr):
        """out [M, N] = bf16(part[0] + part[1] + ... + part[SPLIT - 1]), added in that order (float32).
        GATED: parts are [SPLIT, M, 2N], gate columns [0, N) and up columns [N, 2N), and out = SiLU(gate) *
        up as the masked GEMM computes it. The loop is unrolled (SPLIT is a constant), so that all parts'
        loads are in flight at once, not a chain of dependent steps (benchmarks/RESULTS.md, profile_decode.py).
        CAST: out is then e4m3 and scale_ptr float32 [M, N / GROUP]: the bf16 result cast per token and GROUP
        channels as fp8_cast's kernel casts it (N and BLOCK multiples of GROUP, so a block holds whole groups)."""
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
        if CAST:
            x = tl.reshape(acc.to(tl.bfloat16).to(tl.float32), (BLOCK // GROUP, GROUP))
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
            scale = tl.div_rn(amax, tl.full(amax.shape, LARGEST, tl.float32))
            q = tl.clamp(divide_as_ieee(x, scale[:, None]), -LARGEST, LARGEST)
            tl.store(out_ptr + tl.reshape(offs, (BLOCK // GROUP, GROUP)), q.to(tl.float8e4nv),
                     mask=tl.reshape(ok, (BLOCK // GROUP, GROUP)))
            groups = tl.program_id(0) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
            tl.store(scale_ptr + groups, scale, mask=groups * GROUP < M * N)
        else:
            tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=ok)


def fp8_block_linear(x: torch.Tensor | FP8Rows, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     gated: bool = False, fp8_out: bool = False) -> torch.Tensor | FP8Rows:
    """x [M, K] @ weight.T for an FP8 e4m3 weight [N, K] with 128x128 block scales [ceil(N/128), K/128]:
    x is cast per token and 128 channels as the experts' activations are (or comes cast so: FP8Rows), the
    GEMM is split-K or the masked one with a single group of M rows (no host sync). bf16 [M, N]. gated:
    weight holds gate rows then up rows (N = 2I, I a multiple of 128), and the result is SiLU(gate) * up,
    bf16 [M, I]. fp8_out: the result cast as the next FP8 linear casts its input (FP8Rows; N a multiple of
    128), bit for bit; the split-K GEMM's sum casts it in its own launch."""
    data, scales = x if isinstance(x, tuple) else (None, None)
    m, k = (data if data is not None else x).shape
    if k % FP8_GROUP:
        raise ValueError(f"x: expected a multiple of {FP8_GROUP} input features for an FP8 weight, got {k}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated and (weight.shape[0] % 2 or n % WEIGHT_BLOCK):
        raise ValueError(f"weight: expected gate and up halves of a multiple of {WEIGHT_BLOCK} rows each, "
                         f"got {weight.shape[0]} rows")
    if fp8_out and n % FP8_GROUP:
        raise ValueError(f"fp8_out: needs a multiple of {FP8_GROUP} output features, got {n}")
    device = weight.device
    if data is None:
        data, scales = cast_rows_to_fp8(x.contiguous(), None)  # all m rows: no count to fill first
    if fp8_out and m and takes_splitk(m, k, n, gated, device):
        out = (torch.empty(m, n, dtype=torch.float8_e4m3fn, device=device),
               torch.empty(m, n // FP8_GROUP, dtype=torch.float32, device=device))
        return _fp8_splitk_linear(data, scales, weight, weight_scale_inv, out, gated)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if m and takes_splitk(m, k, n, gated, device):
        _fp8_splitk_linear(data, scales, weight, weight_scale_inv, out, gated)
    elif m:
        count = torch.full((1,), m, dtype=torch.int32, device=device)  # one expert's m rows
        masked_grouped_gemm(data[None], scales[None], weight[None], weight_scale_inv[None], count, out[None],
                            up_offset=n if gated else 0, gated=gated, block_n=_masked_block_n(m, gated))
    return cast_rows_to_fp8(out, None) if fp8_out else out


def takes_splitk(m: int, k: int, n: int, gated: bool, device: torch.device) -> bool:
    """Whether fp8_block_linear runs x [m, k] through an [n, k] weight (gated: n outputs from 2n rows) on the
    split-K GEMM. A decode step's few rows make one row tile: narrow column tiles spread the weight over more
    SMs (at 128 columns a 576- or 7168-wide projection runs on 5 or 56 programs). Where even those tiles are
    fewer than the SMs, K is split as well; and for a deep projection in one row tile, where each narrow tile
    would stream all of K alone (a 2048-deep one stays masked). The shared expert's gated gate_up takes
    split-K too (benchmarks/RESULTS.md, profile_decode.py)."""
    deep = m <= BLOCK_M and k >= SPLITK_MIN_DEPTH
    return m <= SPLITK_MAX_ROWS or deep or _fewer_tiles_than_sms(m, n, _masked_block_n(m, gated), device)


def _masked_block_n(m: int, gated: bool) -> int:
    """The masked GEMM's column tile for m rows; the gated GEMM keeps its own (two accumulators: wider tiles
    spill)."""
    return BLOCK_N_GATED if gated else BLOCK_N_FEW_ROWS if m <= BLOCK_M else BLOCK_N


def _fewer_tiles_than_sms(rows: int, columns: int, block_n: int, device: torch.device) -> bool:
    """Whether one expert's [rows, columns] output makes fewer masked-GEMM tiles than the GPU has SMs: then
    the split-K GEMM is the faster (dense projections and the shared expert at decode sizes)."""
    return cdiv(columns, block_n) * cdiv(rows, BLOCK_M) < sm_count(device)


def _fp8_splitk_linear(data: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                       weight_scale_inv: torch.Tensor, out: torch.Tensor | FP8Rows,
                       gated: bool = False) -> torch.Tensor | FP8Rows:
    """The split-K path of fp8_block_linear, into out bf16 [M, N] (or its FP8 cast, FP8Rows): a decode step's
    few rows give too few tiles to fill the GPU, so the 128-deep blocks of K are spread over programs as well;
    a second launch adds the parts and rounds to bf16 (and casts). gated: weight [2N, K] holds gate rows then
    up rows, and out gets SiLU(gate) * up."""
    target, out_scales = out if isinstance(out, tuple) else (out, None)
    m, k = data.shape
    n = weight.shape[0]
    k_blocks = k // FP8_GROUP
    block_m = SPLITK_MAX_ROWS if m <= SPLITK_MAX_ROWS else BLOCK_M
    tiles = cdiv(n, SPLITK_BLOCK_N) * cdiv(m, block_m)
    split = max(1, min(k_blocks, cdiv(SPLITK_PROGRAMS_PER_SM * sm_count(data.device), tiles)))
    parts = torch.empty(split, m, n, dtype=torch.float32, device=data.device)
    _fp8_splitk_kernel[(cdiv(n, SPLITK_BLOCK_N), split, cdiv(m, block_m))](
        data, scales, weight, weight_scale_inv, parts, m, n, k_blocks, split,
        data.stride(0), scales.stride(0), weight.stride(0), weight_scale_inv.stride(0),
        BLOCK_M=block_m, BLOCK_N=SPLITK_BLOCK_N, BLOCK_K=FP8_GROUP, num_warps=SPLITK_WARPS,
        num_stages=SPLITK_STAGES)
    block = SUM_BLOCK if cdiv(target.numel(), SUM_BLOCK) >= 2 * sm_count(target.device) else SUM_BLOCK_NARROW
    _sum_parts_kernel[(cdiv(target.numel(), block),)](
        parts, target, out_scales if out_scales is not None else target, m, target.shape[1], SPLIT=split,
        GATED=gated, CAST=out_scales is not None, BLOCK=block, GROUP=FP8_GROUP, FLOOR=AMAX_FLOOR, LARGEST=FP8_MAX,
        num_warps=NUM_WARPS)
    return out
