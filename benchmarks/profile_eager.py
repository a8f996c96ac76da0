"""Where the host time of eager calls goes: host microseconds per call (median of many, launches only),
then cProfile's top functions over the same calls and their Python calls per call by where the code lives
(this repository's files, Triton, torch, ...).

Default: a low-latency dispatch and combine in the setting of DeepEP's own benchmark
(tests/test_low_latency.py: torch.set_default_device('cuda'), bfloat16 default dtype, the receive-count
stats tensor, FP8 dispatch, no hook; --group: a one-rank NCCL group as there). Besides the host time of one
call with the GPU idle, the pair is timed queued back to back and as DeepEP's `bench` reads it (CUDA events
around each pair, after one L2 flush).

--stand-in: the Python part of the same dispatch and combine on any machine (no GPU): the cuda backend with a
stand-in for its compiled module (`_C`: launches that do nothing) over CPU tensors, in DeepEP's loop (each call's
results held until the next call rebinds them); host µs per call (medians), then cProfile's view. What Python
adds to a call's launch, to compare code on a development machine; the GPU's host runs its own speed.

--layer: one FusedMoE layer at DeepSeek-V3's shapes (bench_moe.py's: FP8 block weights, EP = 1, the cuda
backend), its eager time (call to GPU done) beside its CUDA-graph replay, as bench_moe times them: the
eager path's host overhead per layer, which a model pays on every eager step; and the CUDA runtime and
driver calls one layer makes (launches, copies, waits, host synchronisations: torch.profiler). Its host time
is taken twice in the same process, side by side: Triton kernels through ep_layer.kernels.launch.Launcher
(as the layer runs) and through Triton's own `kernel[grid]` launch (the baseline the Launcher replaces).

    python benchmarks/profile_eager.py                       # T = 128, H = 7168, E = 288, top-8, EP = 1
    python benchmarks/profile_eager.py --tokens 1 --top 25
    python benchmarks/profile_eager.py --layer --tokens 1
    python benchmarks/profile_eager.py --stand-in                # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from bench_ll import host_time

from ep_layer import Buffer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", action="store_true", help="profile one FusedMoE layer instead of a Buffer's calls")
    p.add_argument("--stand-in", action="store_true",
                   help="the calls' Python part on CPU, with a stand-in for the compiled kernels (no GPU)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--top", type=int, default=20, help="functions to list from cProfile")
    p.add_argument("--group", action="store_true",
                   help="give the Buffer a one-rank NCCL group, as DeepEP's test does (default: no group)")
    args = p.parse_args()
    if args.layer:
        profile_layer(args)
        return
    if args.stand_in:
        profile_stand_in(args)
        return

    group = one_rank_group() if args.group else None
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    t, h, e = args.tokens, args.hidden, args.experts
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(t, h, 1, e), low_latency_mode=True,
                 backend="cuda")
    x = torch.randn(t, h)
    idx = torch.rand(t, e, dtype=torch.float32).topk(args.topk, dim=1).indices
    w = torch.rand(t, args.topk, dtype=torch.float32)
    stats = torch.zeros(e, dtype=torch.int32)
    handle = None

    def dispatch():
        nonlocal handle
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, cumulative_local_expert_recv_stats=stats,
                                                      use_fp8=True, async_finish=False, return_recv_hook=False)

    y = torch.randn(e, t, h)

    def combine():
        buf.low_latency_combine(y, idx, w, handle)

    for _ in range(20):
        dispatch()
        combine()

    def pair():  # as DeepEP's loop alternates them
        dispatch()
        combine()

    rows = [("dispatch", host_time(dispatch, args.calls)), ("combine", host_time(combine, args.calls)),
            ("pair", host_time(pair, args.calls)), ("pair, back to back", back_to_back_host_time(pair, args.calls)),
            ("pair, DeepEP's bench", deepep_bench_time(pair, 50))]

    print_profile(pair, args.calls, args.top)
    print(f"{torch.cuda.get_device_name()}, T = {t}, H = {h}, E = {e}, top-{args.topk}, EP = 1, default device "
          f"cuda, bf16 default dtype, stats tensor, {'a one-rank NCCL group' if group else 'no group'}")
    print("host us: the host's time per call, the GPU idle at its start (synchronized before each); back to back:")
    print("calls queued one after another without a sync; DeepEP's bench: its per-call GPU event interval (µs)")
    print(f"{'call':22s} {'us':>8s}")
    for name, us in rows:
        print(f"{name:22s} {us:8.1f}")
    if group is not None:
        dist.destroy_process_group()


def one_rank_group() -> dist.ProcessGroup:
    """A one-rank NCCL process group on a free local port (DeepEP's tests/utils.py init_dist, one rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                            device_id=torch.device("cuda", 0))
    return dist.new_group([0])


def back_to_back_host_time(fn: Callable[[], object], calls: int) -> float:
    """Mean microseconds of host time per call over `calls` calls queued one after another (no sync between
    them: the GPU may still run earlier ones, as in a serving step or DeepEP's loop)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def deepep_bench_time(fn: Callable[[], object], calls: int) -> float:
    """Mean microseconds between CUDA events recorded around each call, after one L2 flush, as DeepEP's
    tests/utils.py `bench` times its eager dispatch + combine pair (567632d): where the host is slower than
    the GPU, it reads the host's time up to the last launch, plus the last kernel and the event records."""
    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    for _ in range(calls):
        fn()
    flush.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.mean(s.elapsed_time(e) * 1e3 for s, e in list(zip(starts, ends))[1:])


class StandInC:
    """The cuda backend's compiled module as its dispatch and combine calls use it, doing nothing: the host time
    that remains is the calls' Python."""

    @staticmethod
    def read_host_flag(pointer: int) -> int:
        return 0

    @staticmethod
    def launch(*args: object) -> None:
        pass

    dispatch_both_halves = dispatch_send = dispatch_receive = launch
    combine_both_halves = combine_send = combine_receive = launch

    @staticmethod
    def prepared(*args: object, **kwargs: object) -> object:
        return object()

    DispatchShape = CombineShape = CombineOverlap = prepare_dispatch = prepare_combine = prepared


def stand_in_buffer(num_rdma_bytes: int) -> Buffer:
    """A one-rank Buffer on the cuda backend with StandInC for `_C`, on the CPU: its __init__ would allocate
    and map GPU memory, so the backend is assembled from the fields its dispatch and combine read."""
    from ep_layer.backends import cuda
    from ep_layer.backends.base import Backend

    backend = cuda.CudaBackend.__new__(cuda.CudaBackend)
    Backend.__init__(backend, None, 0, 1, num_rdma_bytes, 100.0)
    fields = dict(_c=StandInC, _device=torch.device("cpu"), _num_sms=132, _gpu_share=1, _system_scope=False,
                  _put_ranks=0, _host_flag=0, _commons={}, _output_sets={}, _combine_views={}, _combine_outputs={},
                  _base=1 << 40)
    for name, value in fields.items():
        setattr(backend, name, value)
    backend._common = lambda *args: None  # the launch plan: the stand-in's launches take any
    backend._stream = lambda: 0
    return Buffer.from_backend(backend)


def profile_stand_in(args: argparse.Namespace) -> None:
    """The calls' Python on CPU (--stand-in): dispatch and combine in DeepEP's loop, host µs per call."""
    t, h, e = args.tokens, args.hidden, args.experts
    buf = stand_in_buffer(Buffer.get_low_latency_rdma_size_hint(t, h, 1, e))
    x = torch.randn(t, h, dtype=torch.bfloat16)
    idx = torch.rand(t, e).topk(args.topk, dim=1).indices
    w = torch.rand(t, args.topk)
    y = torch.randn(e, t, h, dtype=torch.bfloat16)
    stats = torch.zeros(e, dtype=torch.int32)
    capturing, torch._C._cuda_isCurrentStreamCapturing = torch._C._cuda_isCurrentStreamCapturing, lambda: False
    try:
        def loop(calls: int) -> tuple[list[float], list[float]]:
            """As DeepEP's test calls them: each call's results held until the next call rebinds them."""
            dispatch_us, combine_us = [], []
            clock = time.perf_counter_ns
            held: list[object] = [None, None]  # the last results, held as the caller's names hold them
            for _ in range(calls):
                start = clock()
                recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e,
                                                                   cumulative_local_expert_recv_stats=stats,
                                                                   use_fp8=True)
                middle = clock()
                held[:] = recv_x, buf.low_latency_combine(y, idx, w, handle)[0]
                dispatch_us.append((middle - start) / 1e3)
                combine_us.append((clock() - middle) / 1e3)
            return dispatch_us, combine_us

        loop(50)
        dispatch_us, combine_us = loop(args.calls)
        print_profile(lambda: loop(1), args.calls, args.top)
    finally:
        torch._C._cuda_isCurrentStreamCapturing = capturing
    d, c = statistics.median(dispatch_us), statistics.median(combine_us)
    print(f"stand-in _C on CPU, T = {t}, H = {h}, E = {e}, top-{args.topk}, EP = 1, DeepEP's loop; host us per call "
          "(medians):")
    print(f"{'call':22s} {'us':>8s}")
    for name, us in (("dispatch", d), ("combine", c), ("pair", d + c)):
        print(f"{name:22s} {us:8.2f}")


def profile_layer(args: argparse.Namespace) -> None:
    """One FusedMoE layer's eager call against its graph replay, then where its host time goes."""
    from bench_moe import Shape, cuda_buffers, hf_tensors, new_layer, require_gpu, time_eager, time_graph

    require_gpu("profile_eager.py --layer")
    shape, device, t = Shape(), torch.device("cuda"), args.tokens
    size = Buffer.get_low_latency_rdma_size_hint(t, shape.hidden, 1, shape.num_experts)
    layer = new_layer(shape, cuda_buffers(1, size)[0], t, device)
    layer.load_weights(hf_tensors(shape, range(shape.num_experts), device, seed=0))
    x = torch.randn(t, shape.hidden, device=device).to(torch.bfloat16)

    def call() -> None:
        layer(x)

    eager, graph = time_eager(call, 20), time_graph(call, 20)
    host = host_time(call, args.calls)
    with triton_own_launches():
        call()  # Triton's cache lookups warm
        triton_host = host_time(call, args.calls)
    print_profile(call, args.calls, args.top)
    print_runtime_calls(call, 20)
    print(f"{torch.cuda.get_device_name()}, FusedMoE at DeepSeek-V3's shapes, T = {t}, EP = 1, µs")
    print(f"eager {eager:.1f} | graph {graph:.1f} | eager / graph {eager / graph:.2f} | host launch {host:.1f} "
          f"| host launch through Triton's own launches {triton_host:.1f}")


@contextmanager
def triton_own_launches() -> Iterator[None]:
    """Every Launcher launch through Triton's `kernel[grid](...)` instead, as before the Launcher (the
    baseline, in the same process)."""
    from ep_layer.kernels.launch import Launcher

    fast = Launcher.launch
    Launcher.launch = lambda self, grid, args, kwargs: self.kernel[grid](*args, **kwargs)
    try:
        yield
    finally:
        Launcher.launch = fast


RUNTIME_CALLS = ("Launch", "Memcpy", "Memset", "Synchronize", "EventRecord", "StreamWaitEvent", "Malloc")


def print_runtime_calls(calls: Callable[[], object], n: int) -> None:
    """CUDA runtime and driver calls per call of `calls` (torch.profiler): kernel launches (ours through the
    runtime, Triton's through the driver), copies, waits and host synchronisations, with their host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            calls()
        torch.cuda.synchronize()
    counts: dict[str, list[float]] = {}
    for event in prof.events():
        if any(word in event.name for word in RUNTIME_CALLS) and event.name != "cudaDeviceSynchronize":
            counts.setdefault(event.name, []).append(event.cpu_time_total)
    print(f"{'runtime call':32s} {'per call':>8s} {'host us each':>12s}")
    for name, times in sorted(counts.items(), key=lambda kv: -len(kv[1])):
        print(f"{name:32s} {len(times) / n:8.1f} {sum(times) / len(times):12.1f}")
    print()


def print_profile(calls: Callable[[], object], n: int, top: int) -> None:
    """cProfile's `top` functions by own time over n calls, then its Python calls and own time per call by
    where the code lives (calls_by_area)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        calls()
    profile.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    print(text.getvalue())
    print(f"{'where':40s} {'calls':>8s} {'own us':>8s}   (per call)")
    for area, count, own_us in calls_by_area(stats, n):
        print(f"{area:40s} {count:8.1f} {own_us:8.1f}")
    print()


def calls_by_area(stats: pstats.Stats, n: int) -> list[tuple[str, float, float]]:
    """(area, function calls, own microseconds) per call of n, most calls first: an area is this repository's
    file (ep_layer/moe/layer.py, ...), an installed package's name (triton, torch, ...), or "builtins" (C
    functions, e.g. torch's operators, as cProfile names them)."""
    totals: dict[str, list[float]] = {}
    for (filename, _, _), (_, calls, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = code_area(filename)
        entry = totals.setdefault(area, [0.0, 0.0])
        entry[0] += calls / n
        entry[1] += own_s * 1e6 / n
    return sorted(((a, c, t) for a, (c, t) in totals.items()), key=lambda row: -row[1])


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # code_area: files of ours


def code_area(filename: str) -> str:
    """Where a profiled function's code lives (calls_by_area)."""
    if filename == "~" or filename.startswith("<"):
        return "builtins"
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):  # installed packages, a virtual environment's in the repo too
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO)
    return "python"  # the standard library


if __name__ == "__main__":
    main()
