"""Linear layers with weights as HF DeepSeek-V3 checkpoints store them: [out, in] in the model dtype,
or float8_e4m3fn with float32 `weight_scale_inv` per 128x128 block (partial last blocks, ceil sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ep_layer.block_fp8 import WEIGHT_BLOCK, block_dequant, num_blocks
from ep_layer.kernels import triton_support
from ep_layer.kernels.fp8_linear import fp8_block_linear


class Linear(nn.Module):
    """y = x W^T (no bias: DeepSeek-V3 has none).

    FP8 weights on a GPU with Triton run as FP8: activations cast per token and 128 channels, block-
    scaled GEMM with float32 accumulation (DeepSeek-V3's inference scheme, ep_layer.kernels.fp8_linear).
    Elsewhere they are dequantised to the activation dtype at each call (exact for the weight values,
    plain PyTorch).
    """

    weight_scale_inv: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, persistent: bool = True,
                 storage: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        """persistent: whether the buffers belong in state_dict (a checkpoint loads them); storage: the
        (weight, weight_scale_inv) tensors to hold instead of new ones (StackedLinear's row slices)."""
        super().__init__()
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        if storage is None:
            weight_dtype = torch.float8_e4m3fn if fp8 else dtype
            weight = torch.zeros(out_features, in_features, dtype=weight_dtype, device=device)
            scale = (torch.ones(num_blocks(out_features), num_blocks(in_features), dtype=torch.float32,
                                device=device) if fp8 else None)
        else:
            weight, scale = storage
        self.register_buffer("weight", weight, persistent=persistent)
        self.register_buffer("weight_scale_inv", scale, persistent=persistent)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's value [out, in] in `dtype` (dequantised for FP8)."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return block_dequant(self.weight, self.weight_scale_inv).to(dtype)

    def runs_fp8(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs the FP8 GEMM (else the dequantised weight in PyTorch)."""
        return self.weight_scale_inv is not None and x.is_cuda and triton_support.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_fp8(x):
            return self.fp8_forward(x)
        return F.linear(x, self.dense_weight(x.dtype))

    def fp8_forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """forward on the FP8 GEMM (runs_fp8(x)), in x's dtype; gated: the weight holds gate rows then up
        rows, and the result is SiLU(gate) * up (half the output features)."""
        y = fp8_block_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, gated=gated)
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.fp8}"


class StackedLinear(nn.Module):
    """Linear layers that read the same input, stored as one weight so that one GEMM computes them all:
    for MLA's q_a_proj and kv_a_proj_with_mqa, one FP8 cast of the input, one split-K GEMM and one sum
    of its parts instead of three kernels each (a decode step's narrow projections are bound by latency,
    not by their weight bytes).

    `parts` are ordinary Linear layers whose buffers are row slices of the stacked ones: the caller
    registers them under their checkpoint names, so a checkpoint loads into the parts, and thereby into
    the stacked weight, which itself is not in state_dict. For FP8 each part takes whole 128-row blocks
    (zero rows pad it), so that the parts' block scales are slices of the stacked ones too. forward
    returns each part's output, a column slice of the one GEMM's."""

    def __init__(self, in_features: int, out_features: Sequence[int], *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        align = WEIGHT_BLOCK if fp8 else 1
        self.starts: list[int] = []
        rows = 0
        for n in out_features:
            self.starts.append(rows)
            rows += -(-n // align) * align
        self.stacked = Linear(in_features, rows, fp8=fp8, dtype=dtype, device=device, persistent=False)
        weight, scale = self.stacked.weight, self.stacked.weight_scale_inv
        self.parts = tuple(
            Linear(in_features, n, fp8=fp8, dtype=dtype,
                   storage=(weight[start:start + n],
                            None if scale is None else scale[start // WEIGHT_BLOCK:num_blocks(start + n)]))
            for start, n in zip(self.starts, out_features))
        self._addresses = self._buffer_addresses()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check_parts()
        y = self.stacked(x)
        return [y[..., start:start + part.out_features] for start, part in zip(self.starts, self.parts)]

    def _buffer_addresses(self) -> list[int]:
        return [b.data_ptr() for m in (self.stacked, *self.parts) for b in m._buffers.values() if b is not None]

    def _check_parts(self) -> None:
        """Raise if any buffer moved since construction: the parts' would then no longer be the stacked
        ones' row slices (addresses only: this runs at every eager call)."""
        if self._buffer_addresses() != self._addresses:
            raise RuntimeError(f"{type(self).__name__}: a part's weight is no longer a slice of the stacked one "
                               "(replaced or moved after construction), so the stacked GEMM would not see it")

    def extra_repr(self) -> str:
        return f"parts at rows {self.starts} of {self.stacked.out_features}"


class GateUpLinear(StackedLinear):
    """A SwiGLU MLP's gate_proj and up_proj (parts 0 and 1) in one GEMM: forward returns SiLU(gate) * up.
    With FP8 weights on a GPU, the gated FP8 GEMM computes both and SiLU(gate) * up from their float32
    sums: one cast, one GEMM (and one sum of its split-K parts) instead of two of each, a SiLU and a
    product."""

    def __init__(self, in_features: int, intermediate: int, *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, (intermediate, intermediate), fp8=fp8, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self._check_parts()
        n, up = self.parts[0].out_features, self.starts[1]
        if self.stacked.runs_fp8(x):  # up rows start at half the stacked rows (both parts padded alike)
            return self.stacked.fp8_forward(x, gated=True)[..., :n]
        y = self.stacked(x)
        return F.silu(y[..., :n]) * y[..., up:up + n]
