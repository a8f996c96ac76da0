"""RMSNorm in one Triton launch (GPU only). serving.models.norm.RMSNorm in PyTorch is eight kernels per
call (cast, square, mean, add, rsqrt, two multiplies, cast back), and a DeepSeek-V3 decode step makes four
calls per layer, plus the final norm: at batch 1 those small kernels are a good part of the step's time.

One program normalises one row: the row's float32 squares are summed, the mean divided exactly, and
rsqrt taken as PyTorch's CUDA kernel takes it; x * rsqrt rounds to x's dtype and is then multiplied by the
weight, rounded again (transformers' order). Only the order of the sum of squares can differ from
PyTorch's reduction, so an output differs from it by at most one unit in the last place, and rarely.

Importing this module needs neither Triton nor a GPU; `available()` says whether it can run.
"""

from __future__ import annotations

import torch

from ep_layer.kernels.launch import Launcher, next_power_of_2
from ep_layer.kernels.triton_support import tl, triton

ELEMENTS_PER_WARP = 1024  # a warp per 1024 channels (32 per lane), at most MAX_WARPS
MAX_WARPS = 16


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @Launcher
    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, dim, stride_x, eps, BLOCK: tl.constexpr):
        """out[row] = weight * (x[row] * rsqrt(mean(x[row]^2) + eps)).to(x's dtype), in x's dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < dim
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        total = tl.sum(h * h, axis=0)
        mean = tl.div_rn(total, tl.zeros_like(total) + dim)
        normed = (h * tl.math.rsqrt(mean + eps)).to(out_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * dim + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of CUDA `x` (any leading shape; rows may be strided), with `weight`
    of x's dtype; returns a new contiguous tensor."""
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected [{dim}] of {x.dtype}, got {list(weight.shape)} of {weight.dtype}")
    rows = x.reshape(-1, dim)
    if dim > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        block = next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, dim, rows.stride(0), eps, BLOCK=block,
                                           num_warps=max(1, min(MAX_WARPS, block // ELEMENTS_PER_WARP)))
    return out.view(x.shape)
