"""Guarded access to the compiled extension `ep_layer._C`: importing ep_layer never needs it."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
from pathlib import Path
from types import ModuleType

from . import kernel_args, layout, quant

NVSHMEM_INSTALL_HINT = "pip install 'ep-layer[nvshmem]' (nvshmem4py-cu13, with the nvidia-nvshmem-cu13 library)"

_module: ModuleType | None = None
_error: str | None = None

# What ep_layer.layout and the kernels (csrc/ll_common.cuh) must agree on; _C exports each under this name.
_SHARED_CONSTANTS = ("CONTROL_BYTES", "MAX_RANKS", "MAX_TOPK", "MAX_EXPERTS", "DISPATCH_HEADER_BYTES",
                     "NORMAL_CONTROL_BYTES", "STAGE_HEADER_BYTES", "NORMAL_LANDING_BYTES", "NORMAL_WARP_LANDING_BYTES")


# The FP8 cast's rule (ep_layer.quant), which the kernels' dispatch applies too; compared in float32.
_FP8_RULE = ("FP8_GROUP", "FP8_MAX", "AMAX_FLOOR")


def _check_constants(module: ModuleType) -> None:
    """Raise ImportError naming the first constant that `module` and ep_layer.layout (or ep_layer.quant)
    disagree on: a stale build of the kernels would otherwise read and write the buffer at the wrong
    offsets, or cast FP8 by another rule than every other backend."""
    expected = [(name, getattr(layout, name), "ep_layer.layout") for name in _SHARED_CONSTANTS]
    expected += [(name, _float32(getattr(quant, name)), "ep_layer.quant") for name in _FP8_RULE]
    for name, value, home in expected:
        built = getattr(module, name, None)
        if (_float32(built) if isinstance(value, float) and built is not None else built) != value:
            raise ImportError(f"{module.__name__} was built with {name} = {built}, but {home} has {name} = "
                              f"{value}: rebuild the CUDA kernels (`pip install -e .`)")


def _float32(value: float) -> float:
    """value rounded to the nearest float32 (the kernels' constants are float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_pointer_orders(module: ModuleType) -> None:
    """Raise ImportError if the launchers' pointer tuples and ep_layer.kernel_args name fields differently."""
    for name, fields in (("DISPATCH_POINTERS", kernel_args.DispatchPointers._fields),
                         ("COMBINE_POINTERS", kernel_args.CombinePointers._fields),
                         ("NORMAL_POINTERS", kernel_args.NormalPointers._fields)):
        built = tuple(getattr(module, name, ()))
        if built != fields:
            raise ImportError(f"{module.__name__} takes {name} in the order {built}, but ep_layer.kernel_args has "
                              f"{fields}: rebuild the CUDA kernels (`pip install -e .`)")


def _try_import() -> None:
    global _module, _error
    if _module is not None or _error is not None:
        return
    if os.environ.get("EP_LAYER_NO_CUDA") == "1":  # a pure-Python install keeps running as one (bootstrap.sh)
        _error = "EP_LAYER_NO_CUDA=1: the CUDA kernels are not loaded"
        return
    try:
        from . import _C
    except ImportError as e:
        _error = str(e)
    else:
        _check_constants(_C)
        _check_pointer_orders(_C)
        _module = _C


def available() -> bool:
    """True when the CUDA kernels were built into this install. Raises ImportError when they were built
    from other sources than this package's (_check_constants)."""
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


def nvshmem_available() -> bool:
    """True when the NVSHMEM build of the kernels (ep_layer._C_nvshmem) and nvshmem4py are installed, so that
    the cuda backend's NVSHMEM transport can run; nothing is imported (that needs NVSHMEM's host library)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("ep_layer._C_nvshmem", "nvshmem.core"))
    except ModuleNotFoundError:  # no nvshmem package at all
        return False


def nvshmem_core() -> ModuleType:
    """nvshmem4py's `nvshmem.core`, or an ImportError that says what to install."""
    try:
        import nvshmem.core
    except ImportError as e:
        raise ImportError(f"transport: 'nvshmem' needs nvshmem4py; {NVSHMEM_INSTALL_HINT}") from e
    return nvshmem.core


def load_nvshmem() -> ModuleType:
    """The NVSHMEM build of the kernels (ep_layer._C_nvshmem), loaded beside the NVSHMEM host library that
    nvshmem4py uses (the module links it, and one host library means one job), or an ImportError that says
    how to get it."""
    nvshmem_core()  # nvshmem4py first: it finds and loads NVSHMEM's host library
    spec = importlib.util.find_spec("nvidia.nvshmem")
    for location in (spec.submodule_search_locations or []) if spec else []:
        host = Path(location) / "lib" / "libnvshmem_host.so.3"
        if host.exists():  # the same file nvshmem4py loaded, so that the module's dependency resolves to it
            ctypes.CDLL(str(host), mode=ctypes.RTLD_GLOBAL)
            break
    try:
        from . import _C_nvshmem
    except ImportError as e:
        raise ImportError(f"ep_layer._C_nvshmem (the kernels built with NVSHMEM) is not available: {e}. Install "
                          f"NVSHMEM ({NVSHMEM_INSTALL_HINT}), then rebuild the kernels (`pip install -e .`, or "
                          "set EP_LAYER_NVSHMEM_HOME to an NVSHMEM install)") from e
    _check_constants(_C_nvshmem)
    _check_pointer_orders(_C_nvshmem)
    return _C_nvshmem
