"""Linear layers with weights as HF DeepSeek-V3 checkpoints store them: [out, in] in the model dtype,
or float8_e4m3fn with float32 `weight_scale_inv` per 128x128 block (partial last blocks, ceil sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ep_layer.moe import block_dequant, triton_experts
from ep_layer.moe.block_fp8 import num_blocks


class Linear(nn.Module):
    """y = x W^T (no bias: DeepSeek-V3 has none).

    FP8 weights on a GPU with Triton run as FP8: activations cast per token and 128 channels, block-
    scaled GEMM with float32 accumulation (DeepSeek-V3's inference scheme, ep_layer.moe's expert
    kernel). Elsewhere they are dequantised to the activation dtype at each call (exact for the
    weight values, plain PyTorch).
    """

    weight_scale_inv: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype, device=device))
        scale = (torch.ones(num_blocks(out_features), num_blocks(in_features), dtype=torch.float32, device=device)
                 if fp8 else None)
        self.register_buffer("weight_scale_inv", scale)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's value [out, in] in `dtype` (dequantised for FP8)."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return block_dequant(self.weight, self.weight_scale_inv).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None and x.is_cuda and triton_experts.available():
            y = triton_experts.fp8_block_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return F.linear(x, self.dense_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.fp8}"
