"""Storage of a group of SwiGLU experts in the layout the expert kernels read.

gate_up [E, 2I', H] holds each expert's gate rows then its up rows, down [E, H, I']; with FP8 block
weights, gate_up_scale [E, 2I'/128, ceil(H/128)] and down_scale [E, ceil(H/128), I'/128] hold the
128x128 `weight_scale_inv` blocks. I' is I rounded up to 128 for FP8 (zero rows and columns), so that
up starts on a scale block and the intermediate activation splits into whole 128-channel groups; the
zero padding adds exactly nothing. For bf16, I' = I.
"""

from __future__ import annotations

import torch
from torch import nn

from ..block_fp8 import WEIGHT_BLOCK, block_dequant, num_blocks


class ExpertWeights(nn.Module):
    """Weights of `num_experts` experts (hidden H, intermediate I), bf16 or FP8 with block scales."""

    gate_up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fp8: bool,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.fp8 = num_experts, hidden, intermediate, fp8
        padded = num_blocks(intermediate) * WEIGHT_BLOCK if fp8 else intermediate
        self.padded_intermediate = padded
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.register_buffer("gate_up", torch.zeros(num_experts, 2 * padded, hidden, dtype=dtype, device=device))
        self.register_buffer("down", torch.zeros(num_experts, hidden, padded, dtype=dtype, device=device))
        gate_up_scale = down_scale = None
        if fp8:
            blocks_i, blocks_h = padded // WEIGHT_BLOCK, num_blocks(hidden)
            gate_up_scale = torch.ones(num_experts, 2 * blocks_i, blocks_h, device=device)
            down_scale = torch.ones(num_experts, blocks_h, blocks_i, device=device)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_scale", down_scale)

    # ------------------------------------------------------------------ float32 views for the PyTorch path
    def gate_up_fp32(self, experts: slice | int) -> torch.Tensor:
        """float32 gate_up of the selected experts (dequantised for FP8)."""
        if self.gate_up_scale is None:
            return self.gate_up[experts].float()
        return block_dequant(self.gate_up[experts], self.gate_up_scale[experts])

    def down_fp32(self, experts: slice | int) -> torch.Tensor:
        """float32 down of the selected experts (dequantised for FP8)."""
        if self.down_scale is None:
            return self.down[experts].float()
        return block_dequant(self.down[experts], self.down_scale[experts])
