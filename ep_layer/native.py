"""Guarded access to the compiled extension `ep_layer._C`: importing ep_layer never needs it."""

from __future__ import annotations

from types import ModuleType

_module: ModuleType | None = None
_error: str | None = None


def _try_import() -> None:
    global _module, _error
    if _module is not None or _error is not None:
        return
    try:
        from . import _C
    except ImportError as e:
        _error = str(e)
    else:
        _module = _C


def available() -> bool:
    """True when the CUDA kernels were built into this install."""
    _try_import()
    return _module is not None


def load() -> ModuleType:
    """The extension module, or an ImportError that says why it is missing and how to build it."""
    _try_import()
    if _module is None:
        raise ImportError(
            f"ep_layer._C (the CUDA kernels) is not available: {_error}. Build it with nvcc on PATH "
            "(`pip install -e .` on a machine with the CUDA toolkit), or use backend='reference'.")
    return _module
