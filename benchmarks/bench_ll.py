"""Low-latency dispatch/combine benchmark: our CUDA kernels vs the reference backend vs the hardware.

Ranks beyond the GPU count are emulated on one GPU (ep_layer.emulation): every rank's send half, then
every rank's receive half, each rank on a CUDA stream of its own so that the ranks' kernels of a phase
run side by side as on separate GPUs, each sized for its share of the GPU (`--serial-ranks`: one after
another on one stream, each with the whole GPU). A time covers the work of all EP ranks together and
is compared with the copy-bandwidth floor for the bytes all of them move. Kernel times come from
CUDA-graph replay (median of many); Python call time is the host time of one eager call. At EP = 1 a
dispatch without a hook runs both halves as one kernel (`disp_us`); the hook's two kernels are timed
too (`hook_us` = `send_us` + `recv_us`). Emulated ranks always use the hook's kernels. With EP = 1 in the
sweep a second table shows eager calls as an engine without CUDA graphs makes them: host time per call and
the GPU time of a dispatch + combine pair with a cold L2. `--transport nvshmem` makes the EP = 1 Buffer
on NVSHMEM's symmetric heap (nvshmem4py) instead of a cudaMalloc'd one, run by the kernels' NVSHMEM build;
`nvshmem-puts` also reaches the rank through NVSHMEM puts (EP_LAYER_NVSHMEM_FORCE_PUTS=1: at EP = 1 its
counts and hellos, as a rank on another node would be reached). Emulated ranks stay on their own
buffers (NVSHMEM runs one PE per process). Where DeepEP's own `deep_ep` is importable (never a dependency; not
ep-layer's drop-in), a last table times it beside ours at EP = 1, on the same inputs in this process.

    python benchmarks/bench_ll.py                      # the full sweep of the issue
    python benchmarks/bench_ll.py --ep 1 --tokens 128 --experts 288
    python benchmarks/bench_ll.py --ep 8 --tokens 1 32 --max-tokens 256   # a decode batch below the buffer's maximum
    python benchmarks/bench_ll.py --ep 1 --tokens 128 --experts 288 --transport nvshmem
    python benchmarks/bench_ll.py --ep 1 --tokens 128 --experts 288 --transport nvshmem-puts
    python benchmarks/bench_ll.py --ep 1 --tokens 128 --experts 288   # with DeepEP installed: beside it too
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ep_layer import Buffer
from ep_layer.backends import nvshmem_heap
from ep_layer.checks import MAX_TOKENS_PER_RANK
from ep_layer.emulation import RankStreams, each_rank, emulated_buffers

DEEPEP_BUFFER_GIB = 1.78  # DeepEP's low-latency buffer at T=128, H=7168, E=256, 8 ranks


def dispatch_bytes_per_pair(hidden: int) -> int:
    """As DeepEP counts an FP8 dispatch message: data, float32 scales, 16 bytes of header."""
    return hidden + hidden // 128 * 4 + 16


def event_us(fn) -> float:
    """Microseconds of GPU time from just before `fn()` is launched to the end of its work (CUDA events;
    waits for the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median of 20)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    samples = [event_us(lambda: dst.copy_(src)) * 1e-6 for _ in range(23)]
    return 2 * nbytes / statistics.median(samples[3:])


def capture_graph(fn, warmup: int, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back `fn()` calls, captured after `warmup` eager calls in a side
    stream (lazy initialisation, Triton compilation)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn, replays: int = 200, warmup: int = 3) -> float:
    """Median microseconds of one `fn()` replayed from a CUDA graph (10 replays per timed graph launch)."""
    inner = 10
    graph = capture_graph(fn, warmup, inner)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(event_us(graph.replay) / inner for _ in range(max(1, replays // inner)))


def host_time(fn, calls: int = 50) -> float:
    """Median microseconds the host spends in one eager call (launches only, no sync inside)."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


class Case:
    """All ranks' inputs for one (EP, T, E) point, and closures for each phase."""

    def __init__(self, ep: int, tokens: int, max_tokens: int, hidden: int, experts: int, topk: int, seed: int,
                 serial_ranks: bool, transport: str = "ipc") -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.ep, self.tokens, self.max_tokens, self.hidden, self.experts = ep, tokens, max_tokens, hidden, experts
        self.size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, ep, experts)
        if ep == 1 and transport.startswith("nvshmem"):
            os.environ[nvshmem_heap.FORCE_PUTS] = "1" if transport == "nvshmem-puts" else "0"
            self.buffers = [Buffer(None, num_rdma_bytes=self.size, low_latency_mode=True, backend="cuda",
                                   transport="nvshmem")]
        else:
            self.buffers = emulated_buffers(ep, self.size, gpu_share=1 if serial_ranks else ep)
        self.streams = RankStreams(ep) if ep > 1 and not serial_ranks else None
        self.xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(ep)]
        scores = [torch.rand(tokens, experts, device="cuda", generator=gen) for _ in range(ep)]
        self.idxs = [s.topk(topk, dim=1).indices for s in scores]
        self.weights = [torch.rand(tokens, topk, device="cuda", generator=gen) for _ in range(ep)]
        self.pairs = sum(int((i >= 0).sum()) for i in self.idxs)
        self.handles: list = []
        num_local = experts // ep
        self.ys = [torch.randn(num_local, ep * max_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
                   for _ in range(ep)]

    def dispatch_send(self):
        return each_rank([
            lambda b=b, x=x, i=i: b.low_latency_dispatch(x, i, self.max_tokens, self.experts, use_fp8=True,
                                                         return_recv_hook=True)
            for b, x, i in zip(self.buffers, self.xs, self.idxs)], self.streams)

    def dispatch_hooked(self):
        sent = self.dispatch_send()
        each_rank([s[4] for s in sent], self.streams)
        return sent

    def dispatch(self):
        """As a caller without hooks would: one call per rank (emulated ranks need the hooks)."""
        if self.ep > 1:
            return self.dispatch_hooked()
        return [self.buffers[0].low_latency_dispatch(self.xs[0], self.idxs[0], self.max_tokens, self.experts,
                                                     use_fp8=True)]

    def combine_eager(self):
        """As a caller without hooks would (emulated ranks need the hooks)."""
        if self.ep > 1:
            return self.combine()
        return [self.buffers[0].low_latency_combine(self.ys[0], self.idxs[0], self.weights[0], self.handles[0])]

    def refresh_handles(self) -> None:
        """Dispatch once so that combine has handles from the buffers' latest dispatches."""
        self.handles = [o[2] for o in self.dispatch()]

    def combine_send(self):
        return each_rank([
            lambda b=b, y=y, i=i, w=w, h=h: b.low_latency_combine(y, i, w, h, return_recv_hook=True)
            for b, y, i, w, h in zip(self.buffers, self.ys, self.idxs, self.weights, self.handles)], self.streams)

    def combine(self):
        sent = self.combine_send()
        each_rank([s[2] for s in sent], self.streams)
        return sent

    def destroy(self) -> None:
        for b in self.buffers:
            b.destroy()


class EagerCase:
    """One rank's eager calls at EP = 1, as an engine without CUDA graphs makes them; on our Buffer, or on
    `buf` (DeepEP's, for the side-by-side table: the same calls, the same inputs)."""

    def __init__(self, tokens: int, hidden: int, experts: int, topk: int, seed: int, buf=None) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.tokens, self.experts = tokens, experts
        self.buf = buf if buf is not None else Buffer(
            None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(tokens, hidden, 1, experts),
            low_latency_mode=True, backend="cuda")
        self.x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        self.idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
        self.w = torch.rand(tokens, topk, device="cuda", generator=gen)
        self.y = torch.randn(experts, tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        self.out = torch.empty_like(self.x)
        self.stats = torch.zeros(experts, dtype=torch.int32, device="cuda")
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def dispatch(self, hook: bool = False, stats: bool = False):
        r = self.buf.low_latency_dispatch(self.x, self.idx, self.tokens, self.experts,
                                          self.stats if stats else None, return_recv_hook=hook)
        if hook:
            r[4]()
        return r

    def combine(self, handle, hook: bool = False, out: bool = False) -> None:
        r = self.buf.low_latency_combine(self.y, self.idx, self.w, handle, return_recv_hook=hook,
                                         out=self.out if out else None)
        if hook:
            r[2]()

    def pair_us(self, stats: bool, default_cuda: bool, samples: int = 50) -> float:
        """GPU time of an eager dispatch + combine (CUDA events around the two calls, L2 flushed before
        each pair; the host's launches are on the critical path): median of `samples`."""
        times = []
        if default_cuda:
            torch.set_default_device("cuda")
        try:
            for _ in range(samples + 3):
                self.flush.zero_()
                times.append(event_us(lambda: self.combine(self.dispatch(stats=stats)[2])))
        finally:
            if default_cuda:
                torch.set_default_device(None)
        return statistics.median(times[3:])

    def row(self) -> tuple:
        for _ in range(5):
            self.combine(self.dispatch()[2])
            self.combine(self.dispatch(hook=True)[2], hook=True)
        dispatch, hooked_dispatch = host_time(self.dispatch, 200), host_time(lambda: self.dispatch(hook=True), 200)
        handle = self.dispatch()[2]  # combines of one dispatch's result, again and again
        combine = [host_time(lambda kw=kw: self.combine(handle, **kw), 200)
                   for kw in ({}, {"out": True}, {"hook": True})]
        pairs = [self.pair_us(stats, dev) for stats in (False, True) for dev in (False, True)]
        return (self.tokens, self.experts, dispatch, combine[0], combine[1], hooked_dispatch, combine[2], *pairs)

    def versus_row(self, name: str) -> tuple:
        """What the side-by-side table compares: kernel GPU times (graph replay), host time per eager call,
        and the eager pair with a cold L2 in the setting of DeepEP's own benchmark (default device cuda,
        the stats tensor)."""
        for _ in range(5):
            self.combine(self.dispatch()[2])
        disp = time_graph(self.dispatch)
        handle = self.dispatch()[2]  # a handle stays valid for two dispatches: combines of it, again and again
        comb = time_graph(lambda: self.combine(handle))
        host_disp = host_time(self.dispatch, 200)
        handle = self.dispatch()[2]
        host_comb = host_time(lambda: self.combine(handle), 200)
        return (name, self.tokens, self.experts, disp, comb, host_disp, host_comb,
                self.pair_us(stats=True, default_cuda=True))


def importable_deep_ep():
    """DeepEP's own `deep_ep` where one is importable, else None (ep-layer's drop-in, BACKEND "ep_layer", is not
    DeepEP). Never a dependency: only the side-by-side table uses it."""
    try:
        import deep_ep
    except ImportError:
        return None
    return None if getattr(deep_ep, "BACKEND", None) == "ep_layer" else deep_ep


def deep_ep_buffer(deep_ep, tokens: int, hidden: int, experts: int):
    """One low-latency Buffer of `deep_ep` for calls of up to `tokens` tokens and `experts` experts, on a
    one-rank gloo group (DeepEP wants a process group; vLLM hands it a gloo one too). One per process:
    DeepEP starts NVSHMEM with its first."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="bench_ll-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, 1, experts)
    return deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=experts)


def beside_deep_ep(deep_ep, tokens: list[int], hidden: int, experts: list[int], topk: int) -> list[tuple]:
    """Rows of ours and of `deep_ep` at EP = 1, on the same inputs, in this process."""
    theirs = deep_ep_buffer(deep_ep, max(tokens), hidden, max(experts))
    name = f"DeepEP {getattr(deep_ep, '__version__', '')}".strip()
    rows = []
    for e in experts:
        for t in tokens:
            rows.append(EagerCase(t, hidden, e, topk, seed=t).versus_row("ep-layer"))
            theirs.clean_low_latency_buffer(t, hidden, e)  # its calls' T and E change here
            rows.append(EagerCase(t, hidden, e, topk, seed=t, buf=theirs).versus_row(name))
    return rows


VERSUS_HEADER = ("impl", "T", "E", "disp_us", "comb_us", "host_disp_us", "host_comb_us", "pair_both_us")
L2_FLUSH_BYTES = 512 << 20  # well past the H200's 60 MB of L2
EAGER_HEADER = ("T", "E", "disp_us", "comb_us", "comb_out_us", "hook_disp_us", "hook_comb_us", "pair_us", "pair_dev_us",
                "pair_stats_us", "pair_both_us")


def reference_times(tokens: int, hidden: int, experts: int, topk: int) -> tuple[float, float]:
    """Eager wall time of the reference backend at EP=1 on the GPU (it synchronises every call)."""
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    idx = torch.rand(tokens, experts, device="cuda").topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, device="cuda")
    y = torch.randn(experts, tokens, hidden, device="cuda").to(torch.bfloat16)
    dispatch, combine = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)[2]
        torch.cuda.synchronize()
        middle = time.perf_counter()
        buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        dispatch.append((middle - start) * 1e6)
        combine.append((time.perf_counter() - middle) * 1e6)
    return statistics.median(dispatch[2:]), statistics.median(combine[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--experts", type=int, nargs="+", default=[256, 288])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the reference backend (EP=1, eager)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="the buffers' num_max_dispatch_tokens_per_rank (default: each T); a decode batch is "
                             "often below it")
    parser.add_argument("--serial-ranks", action="store_true",
                        help="run the emulated ranks' kernels one after another on one stream")
    parser.add_argument("--deep-ep", action=argparse.BooleanOptionalAction, default=True,
                        help="where DeepEP's own deep_ep is importable, time it beside ours at EP = 1 (the same "
                             "inputs, this process)")
    parser.add_argument("--transport", choices=("ipc", "nvshmem", "nvshmem-puts"), default="ipc",
                        help="the EP = 1 Buffer's memory: cudaMalloc (ipc) or NVSHMEM's symmetric heap, its "
                             "rank reached by loads and stores or (nvshmem-puts) by NVSHMEM puts")
    args = parser.parse_args()
    if args.max_tokens is not None and not max(args.tokens) <= args.max_tokens <= MAX_TOKENS_PER_RANK:
        parser.error(f"--max-tokens: expected {max(args.tokens)} (the largest --tokens) to {MAX_TOKENS_PER_RANK}, "
                     f"got {args.max_tokens}")

    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)  "
          f"H={args.hidden} K={args.topk} max_tokens={args.max_tokens or 'T'}")
    size = Buffer.get_low_latency_rdma_size_hint(128, args.hidden, 8, 256)
    print(f"# buffer per rank at T=128, E=256, 8 ranks: {size / 2**30:.3f} GiB "
          f"(DeepEP {DEEPEP_BUFFER_GIB} GiB, ratio {size / 2**30 / DEEPEP_BUFFER_GIB:.2f})")
    header = ("EP", "T", "E", "pairs", "disp_us", "hook_us", "send_us", "recv_us", "disp_floor", "comb_us", "csend_us",
              "crecv_us", "comb_floor", "disp_GB/s", "comb_GB/s", "py_disp_us", "py_comb_us",
              "ref_disp_us", "ref_comb_us")
    rows = []
    for ep in args.ep:
        for experts in args.experts:
            for tokens in args.tokens:
                case = Case(ep, tokens, args.max_tokens or tokens, args.hidden, experts, args.topk,
                            seed=ep * 1000 + tokens, serial_ranks=args.serial_ranks, transport=args.transport)
                disp_bytes = case.pairs * dispatch_bytes_per_pair(args.hidden)
                comb_bytes = case.pairs * 2 * args.hidden
                disp = time_graph(case.dispatch)
                hooked = time_graph(case.dispatch_hooked)
                send = time_graph(case.dispatch_send)
                case.refresh_handles()
                comb = time_graph(case.combine)
                csend = time_graph(case.combine_send)
                py_disp = host_time(case.dispatch) / ep
                case.refresh_handles()
                py_comb = host_time(case.combine_eager) / ep
                ref = reference_times(tokens, args.hidden, experts, args.topk) \
                    if args.reference and ep == 1 else (float("nan"), float("nan"))
                rows.append((ep, tokens, experts, case.pairs, disp, hooked, send, hooked - send,
                             2 * disp_bytes / bw * 1e6, comb, csend, comb - csend, 2 * comb_bytes / bw * 1e6,
                             disp_bytes / disp / 1e3, comb_bytes / comb / 1e3, py_disp, py_comb, *ref))
                case.destroy()
                print(" ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    eager = [EagerCase(tokens, args.hidden, experts, args.topk, seed=tokens).row()
             for experts in args.experts for tokens in args.tokens] if 1 in args.ep else []
    print()
    print("times in microseconds for all EP ranks together (emulated on one GPU); floor = time to copy the "
          "bytes DeepEP counts once at the measured copy bandwidth; py_* = host time per rank per call "
          "(EP = 1: without a hook, one kernel; emulated ranks: send and hook)")
    print_table(header, rows)
    if eager:
        print()
        print("eager calls at EP = 1: host time of one call (median of 200; comb_out_us: with out=; hook_*: the "
              "send and its hook), and the GPU time of an eager dispatch + combine pair with L2 flushed before it "
              "(CUDA events; pair_stats_us: with cumulative_local_expert_recv_stats; pair_dev_us: under "
              "torch.set_default_device('cuda'); pair_both_us: both)")
        print_table(EAGER_HEADER, eager)
    deep_ep = importable_deep_ep() if args.deep_ep and 1 in args.ep else None
    if deep_ep is not None:
        print()
        print(f"beside DeepEP ({deep_ep.__file__}), EP = 1: dispatch (FP8) and combine kernels by graph replay, "
              "host time per eager call, and the eager pair with L2 flushed in DeepEP's benchmark setting (default "
              "device cuda, the stats tensor)")
        print_table(VERSUS_HEADER, beside_deep_ep(deep_ep, args.tokens, args.hidden, args.experts, args.topk))


def print_table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(h), 8) for h in header]
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print(" | ".join((f"{v:.1f}" if isinstance(v, float) else str(v)).rjust(w) for v, w in zip(row, widths)))


if __name__ == "__main__":
    main()
