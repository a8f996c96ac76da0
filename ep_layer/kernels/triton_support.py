"""The Triton import guard and the GPU fact the kernels' fixed grids are sized by.

Importing this module needs neither Triton nor a GPU: without Triton `triton` and `tl` are None, so a
kernel module defines its kernels under `if triton is not None:`; `available()` says whether they can run.
"""

from __future__ import annotations

import functools
import os

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

try:  # grid dependency control (programmatic dependent launch, `tl.extra.cuda.gdc_*` in kernels), Triton 3.4 on
    from triton.language.extra.cuda import gdc_wait
except ImportError:
    gdc_wait = None

# Programmatic dependent launch of the kernels that support it (EP_LAYER_PDL=0 turns it off).
PDL_ENABLED = os.environ.get("EP_LAYER_PDL", "1") != "0"


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


@functools.cache
def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (Hopper on, Triton with grid dependency
    control): such a kernel may start while the kernel before it in its stream finishes, and waits for it
    (`gdc_wait`) before reading anything that kernel may write."""
    return PDL_ENABLED and gdc_wait is not None and torch.cuda.get_device_capability(device) >= (9, 0)
