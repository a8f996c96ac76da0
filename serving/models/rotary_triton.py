"""RoPE in one Triton launch (GPU only). RotaryEmbedding.rotate in PyTorch is two strided slices, six
element-wise kernels and a concatenation per call, two calls per layer (q_pe, k_pe) on a few KB each: at
batch 1 a decode step spends more time launching them than computing.

Program (token, block of heads) rotates its heads' pairs exactly as rotate's PyTorch ops do: each
product, difference and sum computed in float32 and rounded to x's dtype in turn (no fused multiply-adds),
so the result equals PyTorch's bit for bit. Output layout as rotate's: [rotated first halves | rotated second halves].

Importing this module needs neither Triton nor a GPU; `available()` says whether it can run.
"""

from __future__ import annotations

import torch

from ep_layer.kernels.launch import Launcher, cdiv, next_power_of_2
from ep_layer.kernels.triton_support import tl, triton

BLOCK_HEADS = 16  # heads per program


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @Launcher
    @triton.jit
    def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xn, stride_xh, stride_cn,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                       INTERLEAVE: tl.constexpr):
        """out[n, h] = [x1 * cos - x2 * sin | x2 * cos + x1 * sin] with (x1, x2) the pairs of x[n, h]:
        (even, odd) channels if INTERLEAVE, else (first half, second half); cos/sin [n, HALF]."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
        j = tl.arange(0, HALF_PAD)[None, :]
        ok = (h < heads) & (j < HALF)
        row = x_ptr + n * stride_xn + h * stride_xh
        if INTERLEAVE:
            x1 = tl.load(row + 2 * j, mask=ok, other=0.0)
            x2 = tl.load(row + 2 * j + 1, mask=ok, other=0.0)
        else:
            x1 = tl.load(row + j, mask=ok, other=0.0)
            x2 = tl.load(row + HALF + j, mask=ok, other=0.0)
        c = tl.load(cos_ptr + n * stride_cn + j, mask=j < HALF, other=0.0)
        s = tl.load(sin_ptr + n * stride_cn + j, mask=j < HALF, other=0.0)
        dtype = out_ptr.dtype.element_ty
        x1, x2, c, s = x1.to(tl.float32), x2.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
        # PyTorch's ops compute in float32 and round each result to dtype: so do these
        first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
        second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
        out = out_ptr + (n * heads + h) * (2 * HALF) + j
        tl.store(out, first.to(dtype), mask=ok)
        tl.store(out + HALF, second.to(dtype), mask=ok)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RotaryEmbedding.rotate for CUDA x [N, rope_dim] or [N, heads, rope_dim] (rows may be strided; the
    channels contiguous) and cos/sin [N, rope_dim / 2] of x's dtype; returns a new contiguous tensor."""
    n, dim = x.shape[0], x.shape[-1]
    if x.dim() not in (2, 3) or dim % 2:
        raise ValueError(f"x: expected [N, rope_dim] or [N, heads, rope_dim] with an even rope_dim, "
                         f"got {list(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, dim // 2) or t.dtype != x.dtype or t.stride(1) != 1:
            raise ValueError(f"{name}: expected [{n}, {dim // 2}] of {x.dtype}, got {list(t.shape)} of {t.dtype}")
    if sin.stride(0) != cos.stride(0):
        sin = sin.contiguous()
        cos = cos.contiguous()
    rows = x if x.dim() == 3 else x[:, None]
    if rows.stride(2) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    heads = rows.shape[1]
    if n > 0 and heads > 0:
        _rotate_kernel[(n, cdiv(heads, BLOCK_HEADS))](
            rows, cos, sin, out, heads, rows.stride(0), rows.stride(1), cos.stride(0), HALF=dim // 2,
            HALF_PAD=next_power_of_2(dim // 2), BLOCK_HEADS=BLOCK_HEADS, INTERLEAVE=interleave,
            enable_fp_fusion=False)
    return out
