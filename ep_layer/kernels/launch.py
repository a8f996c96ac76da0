"""Triton kernel launches with little host time: `Launcher`, and host-side `cdiv` / `next_power_of_2`.

`kernel[grid](...)` costs ~35 µs of host time per launch in Triton 3.6 on the GPU machine's host, three to
four times the launch itself: it binds and specializes every argument, builds its cache key, reads its
knobs and the current device and stream through several layers of Python (benchmarks/RESULTS.md,
profile_eager.py). An eager MoE layer makes 11 such launches. `Launcher` sends the first launch of each
variant through Triton, which compiles it, and later ones straight to the compiled kernel's launcher. It
finds the variant by the arguments' values first (integers as they are: cheap to key), and by what Triton
specializes on only for values it has not seen.

A variant is everything Triton specializes a compiled kernel on, so that no launch runs code compiled for
other arguments: each tensor's dtype and whether its address is a multiple of 16 bytes; each integer's
divisibility by 16, equality to 1 and whether it fits 32 bits; the constexprs and launch options; the
device. Read from triton/runtime/jit.py (`JITFunction.run`, `create_function_from_signature`) and
triton/compiler/compiler.py (`CompiledKernel`), Triton 3.6.0. Where a launch hook is set (a profiler such
as Proton), every launch goes through Triton, which calls it.

`compile_ahead` compiles the variants a piece of code would launch on a pool of threads, launching nothing: run
under a CUDA graph capture that is never replayed, it moves a start-up's compiles off the critical path.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.6: called from host code
each costs a few µs of wrapping, so the launch sites use the plain ones here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from .triton_support import triton

# Triton's parallel compiles (triton/runtime/_async_compile.py, Triton 3.4 on; None before, or without Triton).
_async_compile = getattr(getattr(triton, "runtime", None), "_async_compile", None)
COMPILES_AHEAD = _async_compile is not None  # whether compile_ahead works here
_INT32 = range(-(2**31), 2**31)
# Triton specialises an integer argument on its divisibility by this (and on equality to 1): code that keeps an
# integer in one class (a multiple of it) runs one compiled variant. The key functions below use the literal.
SPECIALIZED_MULTIPLE = 16
_MAX_VALUE_KEYS = 4096  # per kernel: its call sites' shapes and strides, a token count's few values each


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


@contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[dict[str, int]]:
    """Inside, a Launcher's launch of a variant it has not compiled launches nothing: it hands the compile to a
    pool of `workers` threads (default: the CPUs this process may use) through Triton's AsyncCompileMode, which
    fills the kernel's cache as `kernel.warmup` would. Leaving waits for every compile (and raises the first
    compile error). Triton's compiler releases the GIL in its passes and in ptxas, so the threads overlap.
    The kernels that follow a skipped launch read what it would have written: run the code inside under a CUDA
    graph capture that is never replayed, or where nothing reads its results. Yields a mapping whose
    "variants" counts the compiles handed out. Needs Triton's AsyncCompileMode (Triton 3.4 on: COMPILES_AHEAD)."""
    if _async_compile is None:
        raise RuntimeError("compile_ahead: needs Triton's AsyncCompileMode (Triton 3.4 or later)")
    counts = {"variants": 0}
    workers = workers or len(os.sched_getaffinity(0))
    with (ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool,
          _async_compile.AsyncCompileMode(pool) as mode):
        yield counts
        counts["variants"] = len(mode.future_kernels)


def _compiling_ahead() -> bool:
    """Whether launches happen inside `compile_ahead` (Triton's AsyncCompileMode is active)."""
    return _async_compile is not None and _async_compile.active_mode.get() is not None


def _specializations(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, per runtime argument: a tensor's dtype and 16-byte alignment;
    an integer's equality to 1, divisibility by 16 and 32-bit range; anything else (floats, bools, None) by type
    and value (a few launch sites, values that rarely change). One comprehension: a call per argument would
    cost a frame each (an eager MoE layer passes ~130)."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a % 16 == 0, a in _INT32) if type(a) is int
                  else (type(a), a) for a in args])


def _values(args: tuple) -> tuple:
    """The runtime arguments as a key that is cheap to build: integers by value (equal values specialize alike;
    matching one costs a third of `_specializations`), tensors as there, anything else by type and value."""
    return tuple([a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                  else (type(a), a) for a in args])


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in chains, empty by default; earlier, None)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Written out: any() over a generator costs three times as much, on every launch.
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


class _Variant:
    """One compiled variant: how to launch it, `run(grid_x, grid_y, grid_z, stream, *head, *runtime arguments,
    *constexprs)`. Where the kernel needs no scratch memory, `run` is the compiled launch function itself and
    `head` what Triton's launcher object would add before the arguments (the function, cooperative grid and
    programmatic dependent launch flags, no scratch buffers, the metadata, no launch metadata or hooks): the
    object's Python per launch is left out (triton/backends/nvidia/driver.py, `CudaLauncher.__call__`,
    Triton 3.6.0). Otherwise `run` is that object, and `head` the function, the metadata and three Nones."""

    __slots__ = ("constexprs", "head", "run")

    def __init__(self, kernel: Any, constexprs: tuple) -> None:
        if hasattr(kernel, "result"):  # compiled asynchronously
            kernel = kernel.result()
        launcher = kernel.run  # initializes the handles
        self.constexprs = constexprs
        direct = getattr(launcher, "launch", None)
        scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
        if direct is not None and not scratch:
            self.run = direct
            self.head = (kernel.function, bool(launcher.launch_cooperative_grid), bool(launcher.launch_pdl), None,
                         None, kernel.packed_metadata, None, None, None)
        else:
            self.run = launcher
            self.head = (kernel.function, kernel.packed_metadata, None, None, None)


class Launcher:
    """Launches of one @triton.jit kernel: `Launcher(kernel)[grid](*runtime_args, **constexprs_and_options)`,
    the runtime arguments in the kernel's order, positionally, and every constexpr after them in the signature
    (passed by name, or left to its default). See the module's docstring."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._variants: dict[tuple, _Variant] = {}  # by what Triton specializes on
        self._by_value: dict[tuple, _Variant] = {}  # the same variants by the arguments' values (_values)

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, object]) -> None:
        device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its lazy-init check (Triton's device)
        options = tuple(kwargs.items())
        by_value = (device, _values(args), options)
        variant = self._by_value.get(by_value)
        if variant is None:
            key = (device, _specializations(args), options)
            variant = self._variants.get(key)
            if variant is None:
                if _compiling_ahead():
                    self.kernel.warmup(*args, grid=grid, **kwargs)
                    return
                constexprs = self._constexprs(len(args), kwargs)
                self._variants[key] = _Variant(self.kernel[grid](*args, **kwargs), constexprs)
                return
            if len(self._by_value) >= _MAX_VALUE_KEYS:  # argument values that vary from call to call
                self._by_value.clear()
            self._by_value[by_value] = variant
        if _hooked():
            self.kernel[grid](*args, **kwargs)
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        variant.run(grid[0], grid_y, grid_z, stream, *variant.head, *args, *variant.constexprs)

    def _constexprs(self, runtime: int, kwargs: dict[str, object]) -> tuple:
        """The values of the constexprs after the `runtime` positional arguments, in the signature's order (the
        compiled launcher takes every parameter and skips the constexprs); raises where the call does not pass
        the runtime arguments positionally, first."""
        params = self.kernel.params
        if any(p.is_constexpr for p in params[:runtime]) or not all(p.is_constexpr for p in params[runtime:]):
            raise TypeError(f"Launcher({self.kernel.fn.__name__}): pass its {sum(not p.is_constexpr for p in params)} "
                            f"runtime arguments positionally and only constexprs by name; got {runtime} positional")
        return tuple(kwargs.get(p.name, p.default) for p in params[runtime:])
