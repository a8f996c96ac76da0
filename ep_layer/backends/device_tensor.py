"""Torch tensors over device memory the cuda backend allocated itself (its communication buffers)."""

from __future__ import annotations

import torch


class _DeviceArray:
    """Device memory that torch.as_tensor can view without a copy (CUDA array interface, as bytes)."""

    def __init__(self, pointer: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (pointer, False),
                                         "strides": None, "version": 3, "stream": None}


def device_tensor(pointer: int, shape: tuple[int, ...], device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A `dtype` tensor over memory the backend owns (alive until destroy); kept across calls, so made
    outside inference mode (writable in and out of it)."""
    with torch.inference_mode(False):
        data = torch.as_tensor(_DeviceArray(pointer, (*shape[:-1], shape[-1] * dtype.itemsize)), device=device)
        return data.view(dtype)
