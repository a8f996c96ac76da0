"""The Triton import guard and the GPU fact the kernels' fixed grids are sized by.

Importing this module needs neither Triton nor a GPU: without Triton `triton` and `tl` are None, so a
kernel module defines its kernels under `if triton is not None:`; `available()` says whether they can run.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # no Triton in this install: the PyTorch paths still work
    triton = None
    tl = None
    _IMPORT_ERROR: str | None = str(error)
else:
    _IMPORT_ERROR = None


def available() -> bool:
    """True when Triton imports and torch sees a CUDA GPU."""
    return triton is not None and torch.cuda.is_available()


def unavailable_reason() -> str:
    """Why `available()` is False (for skip messages and errors), else "available"."""
    if triton is None:
        return f"Triton does not import: {_IMPORT_ERROR}"
    return "torch sees no CUDA GPU" if not torch.cuda.is_available() else "available"


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, which the kernels' fixed grids are sized by (asked once per device: the
    properties lookup costs host time at every launch)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
