"""Normal mode's weighted sum of each received token's expert outputs in one Triton launch (GPU only):
out[i] = Σ_k w[i, k] · y[slot[i, k]] over the entries with slot ≥ 0, in float32, ascending k, each product and
each sum rounded to float32 on its own (no fused multiply-add, as csrc/ll_combine.cu's `__fmul_rn` and
`__fadd_rn`), rounded to bf16 once: bit for bit what ExpertKernels.weighted_rows computes in PyTorch.
"""

from __future__ import annotations

import torch

from .launch import Launcher, cdiv
from .triton_support import tl, triton

BLOCK = 1024  # channels per program
NUM_WARPS = 4

if triton is not None:

    @Launcher
    @triton.jit
    def _weighted_rows_kernel(y_ptr, slot_ptr, w_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (token, BLOCK channels): its K entries' rows of y, weighted and summed in order."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + row * K + k)
            weight = tl.load(w_ptr + row * K + k)
            here = slot >= 0
            y = tl.load(y_ptr + tl.maximum(slot, 0) * hidden + cols, mask=inside & here, other=0.0).to(tl.float32)
            acc = tl.where(here, acc + weight * y, acc)
        tl.store(out_ptr + row * hidden + cols, acc.to(tl.bfloat16), mask=inside)


def weighted_rows(y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out bf16 [N, H] from y bf16 [R, H], slot int64 [N, K] (a row of y, or -1: none) and weights float32 [N, K],
    y, slot and weights contiguous, on one GPU (see the module's docstring)."""
    n, hidden = out.shape
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    if n:
        _weighted_rows_kernel[(n, cdiv(hidden, BLOCK))](y, slot, weights, target, hidden, K=slot.shape[1],
                                                        BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out if target is out else out.copy_(target)
