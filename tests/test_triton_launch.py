"""ep_layer.kernels.launch: a Triton kernel's launches after the first of each variant skip Triton's binding.

On CPU, against a stand-in that keeps Triton 3.6's contract (triton/runtime/jit.py `JITFunction.run`: the
first launch returns the compiled kernel; triton/compiler/compiler.py: its `run` takes the grid, the
stream, the function, the packed metadata, the launch metadata and hooks, then every parameter in the
signature's order, constexprs included): which launches compile, what the compiled launcher receives, and
that a new alignment or divisibility is a new variant. On a GPU, real kernels on misaligned inputs.
"""

from __future__ import annotations

import math
import random
from contextvars import ContextVar
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from ep_layer.kernels import launch, triton_support
from ep_layer.kernels.launch import Launcher, cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_exact_math() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        a, b = rng.randrange(0, 1 << 40), rng.randrange(1, 1 << 20)
        assert cdiv(a, b) == math.ceil(Fraction(a, b))
    for n in range(1, 5000):
        assert next_power_of_2(n) == 2 ** math.ceil(math.log2(n))
    assert next_power_of_2(0) == 1


class _Param:
    def __init__(self, name: str, constexpr: bool, default: object = None) -> None:
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _StandIn:
    """A @triton.jit kernel as Launcher sees it: kernel(x_ptr, n, scale, BLOCK: constexpr, EVEN: constexpr = True)."""

    def __init__(self) -> None:
        self.params = [_Param("x_ptr", False), _Param("n", False), _Param("scale", False),
                       _Param("BLOCK", True), _Param("EVEN", True, default=True)]
        self.fn = SimpleNamespace(__name__="stand_in_kernel")
        self.compiles: list[tuple] = []  # launches through "Triton"
        self.fast: list[tuple] = []  # launches through a compiled kernel's launcher
        self.ahead: list[tuple] = []  # compiles handed to AsyncCompileMode's threads by `warmup`

    def warmup(self, *args, grid, **kwargs):
        """Triton's `warmup` inside an AsyncCompileMode: the compile goes to the mode's executor, nothing launches."""
        mode = _AsyncCompileStandIn.active_mode.get()
        key = (args[1] % 16 == 0, tuple(kwargs.items()))  # what this stand-in specializes on
        if key not in mode.future_kernels:
            mode.future_kernels[key] = mode.executor.submit(lambda: self.ahead.append((grid, args, kwargs)))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            number = len(self.compiles)
            return SimpleNamespace(run=lambda *a: self.fast.append((number, a)), function=f"function{number}",
                                   packed_metadata=f"metadata{number}")
        return run


class _AsyncCompileStandIn:
    """triton.runtime._async_compile as Triton 3.6 has it: AsyncCompileMode(executor) activates itself in
    `active_mode` and, on leaving, waits for the compiles submitted (`future_kernels`, by cache key)."""

    active_mode: ContextVar = ContextVar("stand_in_async_compile", default=None)

    class AsyncCompileMode:
        def __init__(self, executor) -> None:
            self.executor, self.future_kernels = executor, {}

        def __enter__(self):
            _AsyncCompileStandIn.active_mode.set(self)
            return self

        def __exit__(self, *exc) -> None:
            for future in self.future_kernels.values():
                future.result()
            _AsyncCompileStandIn.active_mode.set(None)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> tuple[_StandIn, SimpleNamespace]:
    runtime = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    monkeypatch.setattr(launch, "triton", SimpleNamespace(knobs=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(launch, "_async_compile", _AsyncCompileStandIn)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    return _StandIn(), runtime


def _aligned(n: int) -> torch.Tensor:
    t = torch.zeros(n + 16, dtype=torch.uint8)
    start = -t.data_ptr() % 16
    return t[start:start + n]


def test_a_variant_compiles_once_then_launches_through_its_compiled_kernel(stand_in) -> None:
    kernel, _ = stand_in
    launcher = Launcher(kernel)
    x, y = _aligned(64), _aligned(64)
    launcher[(4,)](x, 32, 0.5, BLOCK=128, num_warps=4)
    assert len(kernel.compiles) == 1 and not kernel.fast
    launcher[(5, 2)](y, 48, 0.5, BLOCK=128, num_warps=4)  # another tensor, same alignment; 48 % 16 == 0 as 32
    assert len(kernel.compiles) == 1
    ((number, args),) = kernel.fast
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter, the default last
    assert number == 1
    assert args == (5, 2, 1, 1234, "function1", "metadata1", None, None, None, y, 48, 0.5, 128, True)


class _CudaLauncherStandIn:
    """Triton 3.6's launcher object (driver.py, CudaLauncher) as _Variant reads it: its compiled `launch`, the
    scratch sizes and the launch flags; calling the object itself is the path with its own Python."""

    def __init__(self, scratch: int, calls: list) -> None:
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launch = lambda *a: calls.append(("launch", a))
        self.calls = calls

    def __call__(self, *a) -> None:
        self.calls.append(("object", a))


@pytest.mark.parametrize("scratch", [0, 256])
def test_a_kernel_without_scratch_launches_through_its_compiled_launch_function(stand_in, scratch: int) -> None:
    """With no scratch memory to allocate per launch, the compiled launch function gets what Triton's launcher
    object would pass it; a kernel that needs scratch keeps going through the object."""
    calls: list = []
    compiled = SimpleNamespace(run=_CudaLauncherStandIn(scratch, calls), function="fn", packed_metadata="meta")

    class Kernel(_StandIn):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled  # "Triton" compiles and launches, returning the compiled kernel

    launcher = Launcher(Kernel())
    x = _aligned(64)
    launcher[(4,)](x, 32, 0.5, BLOCK=128)
    launcher[(3, 2)](x, 32, 0.5, BLOCK=128)
    ((how, args),) = calls
    if scratch:
        assert how == "object" and args == (3, 2, 1, 1234, "fn", "meta", None, None, None, x, 32, 0.5, 128, True)
    else:
        assert how == "launch"
        assert args == (3, 2, 1, 1234, "fn", False, True, None, None, "meta", None, None, None, x, 32, 0.5, 128, True)


@pytest.mark.parametrize("change", ["misaligned", "not_16", "one", "wide", "dtype", "constexpr", "option", "scale"])
def test_anything_triton_specializes_on_is_a_new_variant(stand_in, change: str) -> None:
    kernel, _ = stand_in
    launcher = Launcher(kernel)
    x = _aligned(64)
    launcher[(1,)](x, 32, 0.5, BLOCK=128, num_warps=4)
    args, kwargs = [x, 32, 0.5], {"BLOCK": 128, "num_warps": 4}
    if change == "misaligned":
        args[0] = _aligned(65)[1:]
    elif change == "not_16":
        args[1] = 33
    elif change == "one":
        args[1] = 1
    elif change == "wide":
        args[1] = 2**31 + 16  # an int64 argument
    elif change == "dtype":
        args[0] = x.view(torch.int8)
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        args[2] = 0.25  # floats are keyed by value
    launcher[(1,)](*args, **kwargs)
    assert len(kernel.compiles) == 2 and not kernel.fast
    launcher[(1,)](*args, **kwargs)
    assert len(kernel.compiles) == 2 and kernel.fast[0][0] == 2  # the second variant's compiled kernel


def test_integer_values_seen_are_bounded_and_share_their_variant(stand_in) -> None:
    """Integers key a launch by value (cheap), so a token count's many values are remembered up to a bound, and
    all of them that Triton specializes alike launch the one compiled kernel."""
    kernel, _ = stand_in
    launcher = Launcher(kernel)
    x = _aligned(64)
    values = [16 * (i + 2) for i in range(launch._MAX_VALUE_KEYS + 10)]
    for n in values + values[:3]:
        launcher[(1,)](x, n, 0.5, BLOCK=128)
    assert len(kernel.compiles) == 1
    assert [args[10] for _, args in kernel.fast] == values[1:] + values[:3]
    assert len(launcher._by_value) <= launch._MAX_VALUE_KEYS


@pytest.mark.parametrize("hook", ["launch_enter_hook", "launch_exit_hook"])
def test_with_a_launch_hook_every_launch_goes_through_triton(stand_in, hook: str) -> None:
    kernel, runtime = stand_in
    launcher = Launcher(kernel)
    x = _aligned(64)
    getattr(runtime, hook).calls.append(print)
    for _ in range(3):
        launcher[(1,)](x, 32, 0.5, BLOCK=128)
    assert len(kernel.compiles) == 3 and not kernel.fast
    getattr(runtime, hook).calls.clear()
    launcher[(1,)](x, 32, 0.5, BLOCK=128)
    assert len(kernel.fast) == 1


def test_runtime_arguments_by_name_are_refused_naming_the_kernel(stand_in) -> None:
    kernel, _ = stand_in
    with pytest.raises(TypeError, match=r"stand_in_kernel.*3 runtime arguments positionally"):
        Launcher(kernel)[(1,)](_aligned(64), 32, scale=0.5, BLOCK=128)
    assert not kernel.compiles  # refused before any launch


def test_inside_compile_ahead_unseen_variants_are_compiled_on_threads_and_not_launched(stand_in) -> None:
    kernel, _ = stand_in
    launcher = Launcher(kernel)
    x = _aligned(64)
    launcher[(1,)](x, 32, 0.5, BLOCK=128)  # compiled before: launches inside too
    with launch.compile_ahead(workers=3) as compiled:
        launcher[(2,)](x, 32, 0.5, BLOCK=128)
        launcher[(3,)](x, 7, 0.5, BLOCK=128)  # 7: another class of n, a new variant
        launcher[(4,)](x, 9, 0.5, BLOCK=128)  # the same one again
        launcher[(5,)](x, 32, 0.5, BLOCK=64)  # another constexpr
    assert compiled["variants"] == 2
    assert [grid for grid, _, _ in kernel.ahead] in ([(3,), (5,)], [(5,), (3,)])  # on threads, in any order
    assert len(kernel.compiles) == 1 and [n for n, _ in kernel.fast] == [1]  # only the compiled variant ran
    launcher[(6,)](x, 7, 0.5, BLOCK=128)  # outside: through Triton, which finds what the threads compiled
    assert len(kernel.compiles) == 2


def test_compile_ahead_waits_for_its_compiles_when_the_code_inside_raises(stand_in) -> None:
    kernel, _ = stand_in
    with pytest.raises(ValueError, match="inside"), launch.compile_ahead(workers=2):
        Launcher(kernel)[(1,)](_aligned(64), 7, 0.5, BLOCK=128)
        raise ValueError("inside")
    assert len(kernel.ahead) == 1 and _AsyncCompileStandIn.active_mode.get() is None


def test_compile_ahead_refuses_a_triton_without_async_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_async_compile", None)
    with pytest.raises(RuntimeError, match="AsyncCompileMode"), launch.compile_ahead():
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason())
def test_kernels_compiled_ahead_in_a_throwaway_capture_launch_without_compiling_on_a_gpu() -> None:
    """A kernel of its own (an empty cache): its launch inside compile_ahead, under a capture never replayed,
    compiles it and runs nothing; the launch after it finds the compiled kernel in Triton's cache."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    launcher = Launcher(add_one)
    x = torch.zeros(1000, device="cuda")
    with launch.compile_ahead() as compiled, torch.cuda.graph(torch.cuda.CUDAGraph()):
        launcher[(cdiv(1000, 256),)](x, 1000, BLOCK=256)
    assert compiled["variants"] == 1
    cache = add_one.device_caches[torch.cuda.current_device()][0]
    assert len(cache) == 1 and not x.any()  # compiled, and nothing ran
    launcher[(cdiv(1000, 256),)](x, 1000, BLOCK=256)
    assert len(cache) == 1 and torch.equal(x, torch.ones_like(x))  # no second compile


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason())
def test_misaligned_rows_get_their_own_compiled_kernel_on_a_gpu() -> None:
    """The FP8 cast (vector loads where rows are 16-byte aligned) on aligned rows, then on the same values 2
    bytes off, then aligned again: the same bits each time, and two compiled variants."""
    from ep_layer.kernels.fp8_cast import _cast_rows_kernel, cast_rows_to_fp8

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 24, 512, generator=gen, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([24, 7], dtype=torch.int32, device="cuda")
    want = cast_rows_to_fp8(x, counts)
    before = len(_cast_rows_kernel._variants)
    off = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(x.shape).copy_(x)
    assert off.data_ptr() % 16
    for rows in (off, x, off):
        data, scales = cast_rows_to_fp8(rows, counts)
        for e, n in enumerate(counts.tolist()):
            assert torch.equal(scales[e, :n], want[1][e, :n])
            assert torch.equal(data[e, :n].view(torch.uint8), want[0][e, :n].view(torch.uint8))
    assert len(_cast_rows_kernel._variants) == before + 1
