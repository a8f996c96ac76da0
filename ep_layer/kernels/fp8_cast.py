"""The per-token-per-128 FP8 cast of activations in one Triton launch (GPU only): the expert MLP's
intermediate (the rows each expert received) and the dense FP8 linear's input. Bit-exact with the
design's rule (ep_layer.quant, docs/design.md section 2, with quant's constants): IEEE float32
divisions, scales max(amax, AMAX_FLOOR) / FP8_MAX, e4m3 saturated at +-FP8_MAX.
"""

from __future__ import annotations

import torch

from ..quant import AMAX_FLOOR, FP8_GROUP, FP8_MAX
from .launch import Launcher, cdiv, next_power_of_2
from .triton_support import sm_count, tl, triton

CAST_ROWS = 32  # rows per item of the cast
CAST_PROGRAMS_PER_SM = 4  # the cast's fixed grid
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def divide_as_ieee(x, s):
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


    @Launcher
    @triton.jit
    def _cast_rows_kernel(x_ptr, q_ptr, s_ptr, count_ptr, E, M, I, GROUPS, E_PAD: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr, ALL_ROWS: tl.constexpr,
                          FLOOR: tl.constexpr, LARGEST: tl.constexpr):
        """FP8 cast of x [E, M, I] by [BLOCK_ROWS, GROUP] tiles (the design's rule, IEEE float32 divisions):
        scale = max(amax, FLOOR) / LARGEST per row and group, q = e4m3(x / scale), saturated. A fixed grid
        shares out the (row tile, group) items of the received rows only, numbered expert by expert (as
        the masked GEMM's), so no program exists for rows that were not received. ALL_ROWS: all M rows of
        every expert (count_ptr unused)."""
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
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
            scale = tl.div_rn(amax, tl.full(amax.shape, LARGEST, tl.float32))
            q = tl.clamp(divide_as_ieee(x, scale[:, None]), -LARGEST, LARGEST)
            tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=ok[:, None])
            tl.store(s_ptr + expert * M * GROUPS + rows * GROUPS + group, scale, mask=ok)


def cast_rows_to_fp8(x: torch.Tensor, recv_count: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-per-128 FP8 cast of x [E, M, I] (contiguous) for rows below recv_count only (others untouched;
    None: all rows): (e4m3 [E, M, I], float32 scales [E, M, I/128]). x [M, I] is one group:
    (e4m3 [M, I], float32 [M, I/128]), without the views a leading dimension of 1 would cost the host."""
    *lead, m, i = x.shape
    e = lead[0] if lead else 1
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*lead, m, i // FP8_GROUP), dtype=torch.float32, device=x.device)
    groups = i // FP8_GROUP
    programs = min(CAST_PROGRAMS_PER_SM * sm_count(x.device), e * cdiv(m, CAST_ROWS) * groups)
    _cast_rows_kernel[(max(1, programs),)](x, q, s, recv_count, e, m, i, groups, E_PAD=next_power_of_2(e),
                                           BLOCK_ROWS=CAST_ROWS, GROUP=FP8_GROUP, ALL_ROWS=recv_count is None,
                                           FLOOR=AMAX_FLOOR, LARGEST=FP8_MAX, num_warps=NUM_WARPS)
    return q, s
