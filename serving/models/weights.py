"""Checking checkpoint tensors against the storage they are copied into."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: a tensor is missing, unexpected, mis-shaped or mistyped,
    or a file is missing or unreadable. The message names the tensor or file."""


def copy_checked(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """target.copy_(tensor) after checking shape and kind (FP8 into FP8 storage, float into float)."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"{name}: expected shape {list(target.shape)}, got {list(tensor.shape)}")
    if target.dtype == torch.float8_e4m3fn:
        if tensor.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: expected dtype torch.float8_e4m3fn (config.json has an FP8 "
                                  f"quantization_config), got {tensor.dtype}")
    elif not tensor.is_floating_point() or tensor.dtype in FP8_DTYPES:
        hint = (" (an FP8 checkpoint: config.json needs its quantization_config)" if tensor.dtype in FP8_DTYPES
                else "")
        raise CheckpointError(f"{name}: expected a bf16, fp16 or fp32 tensor, got {tensor.dtype}{hint}")
    target.copy_(tensor)
