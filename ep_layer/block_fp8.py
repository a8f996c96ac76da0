"""128x128 block-scaled FP8 weights, the HF DeepSeek-V3 convention: a weight [R, C] is stored as
float8_e4m3fn plus float32 `weight_scale_inv` [ceil(R/128), ceil(C/128)], and its value is
fp8 * scale_inv of the element's block (the last row and column blocks may be partial).
"""

from __future__ import annotations

import torch

from .quant import FP8_MAX

WEIGHT_BLOCK = 128


def num_blocks(n: int) -> int:
    """Blocks of WEIGHT_BLOCK that cover n rows or columns."""
    return -(-n // WEIGHT_BLOCK)


def expand_block_scales(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """float32 [..., rows, cols]: each element's block scale, from [..., ceil(rows/128), ceil(cols/128)]."""
    per_row = scale_inv.float().repeat_interleave(WEIGHT_BLOCK, dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(WEIGHT_BLOCK, dim=-1)[..., :cols]


def block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 value of an fp8 weight [..., R, C] with its block scales."""
    rows, cols = weight.shape[-2:]
    return weight.float() * expand_block_scales(scale_inv, rows, cols)


def block_cast_to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a float weight [R, C] to (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)]).

    scale_inv = amax of the block / 448 (all-zero blocks get 1), so each block spans e4m3's range.
    """
    rows, cols = weight.shape
    rb, cb = num_blocks(rows), num_blocks(cols)
    padded = weight.float().new_zeros(rb * WEIGHT_BLOCK, cb * WEIGHT_BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(rb, WEIGHT_BLOCK, cb, WEIGHT_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data.view(rb * WEIGHT_BLOCK, cb * WEIGHT_BLOCK)[:rows, :cols].contiguous(), scale_inv
