"""Fused MoE layer benchmark at DeepSeek-V3's shapes (FP8 block weights): the reference backend vs our
cuda backend, the plain schedule vs single-batch overlap (sbo) vs two micro-batches, eager vs CUDA-graph
replay; the expert GEMMs against the HBM roofline; the communication time each overlap hides; and the
cost model of ep_layer.moe.overlap beside the measurements, with what FusedMoE(overlap="auto") picks.

EP = 1 is one real rank; larger EP sizes are emulated on one GPU (ep_layer.emulation): one layer per
rank, each with its own experts (E / EP of them: the weights total the same ~11 GB at every EP size)
and its own T tokens, driven in step. A time covers the work of all EP ranks together.

Both schedules run their communication on side streams (ep_layer.moe.CommStreams, shared by the
emulated ranks), as FusedMoE runs them on a GPU: the plain one's dispatch beside the shared expert, the
two-micro-batch one's under the other half's compute. The latter runs again with everything on one
stream, where nothing overlaps. The difference, over the time of the halves' communication alone, is
the share of the communication that the overlap hides (`hid%`); `hid_max%` is the share the GPU hides when the same
communication runs beside the routed experts' GEMMs alone with no dependency at all (the schedule also
has the gate, routing and shared expert to run it under, so it can hide more). The split itself costs
time at decode sizes (each half reads every active expert's weights again); plain vs ovl shows that cost.
Single-batch overlap runs one batch with each rank's combine send beside its down GEMM, sending rows as
the GEMM signals them; it and the plain schedule are replayed in turn, and their difference over the
communication's time alone is the share it hides (`sbo_hid%`).

Weights are random (e4m3 codes with random 128x128 block scales, made on the GPU) and loaded by their
HF names; routing is DeepSeek-V3's noaux_tc on random router weights, so load is near uniform.

    python benchmarks/bench_moe.py --smoke       # tiny layer (H=512, 16 experts, I=256): run this first
    python benchmarks/bench_moe.py               # EP 1 2 4 8 x T 1 32 128 256 (a few minutes on an H200)
    python benchmarks/bench_moe.py --quick       # T 1 128, fewer repetitions
    python benchmarks/bench_moe.py --ep 8 --tokens 128
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from bench_ll import capture_graph, copy_bandwidth, event_us  # this script's folder is on sys.path

from ep_layer import Buffer, native
from ep_layer.block_fp8 import num_blocks
from ep_layer.checks import MAX_TOKENS_PER_RANK
from ep_layer.emulation import emulated_buffers
from ep_layer.kernels import triton_support
from ep_layer.layout import MAX_RANKS
from ep_layer.moe import CommStreams, FusedMoE, run_interleaved
from ep_layer.moe.layer import chain_steps, forward_two_microbatches, microbatches
from ep_layer.moe.overlap import Prediction
from ep_layer.moe.schedule import COMBINE_SENT, DISPATCH_SENT, Steps

PROJECTIONS = ("gate", "up", "down")
FP8_CODE_SPREAD = 64.0  # randn * 64 spans e4m3's range; the block scales undo it
EXPERT_KERNELS = "triton"  # FusedMoE's expert_kernels: fail rather than time a fallback


@dataclass(frozen=True)
class Shape:
    """A DeepSeek-V3 MoE layer's sizes (config.json names in the comments)."""

    hidden: int = 7168  # hidden_size
    num_experts: int = 256  # n_routed_experts
    intermediate: int = 2048  # moe_intermediate_size
    top_k: int = 8  # num_experts_per_tok
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    n_shared_experts: int = 1

    def proj_shape(self, projection: str, intermediate: int) -> tuple[int, int]:
        """[rows, cols] of a `{projection}_proj.weight` in an HF checkpoint."""
        return (self.hidden, intermediate) if projection == "down" else (intermediate, self.hidden)


DEEPSEEK_V3 = Shape()
SMOKE = Shape(hidden=512, num_experts=16, intermediate=256, top_k=4, n_group=4, topk_group=2)


@dataclass(frozen=True)
class Reps:
    """Timed repetitions (each result is the median)."""

    eager: int
    graph: int
    reference: int


FULL_REPS = Reps(eager=20, graph=30, reference=8)
QUICK_REPS = Reps(eager=5, graph=10, reference=3)


# ---------------------------------------------------------------------------- requirements
def require_gpu(script: str = "bench_moe.py") -> None:
    """Exit with a clear message unless there is a GPU, our CUDA kernels and Triton."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU, and torch {torch.__version__} sees none "
                 f"(torch CUDA build: {torch.version.cuda})")
    try:
        native.load()
    except ImportError as error:
        sys.exit(f"{script} needs the CUDA kernels: {error}")
    if not triton_support.available():
        sys.exit(f"{script} needs Triton for the expert GEMMs: {triton_support.unavailable_reason()}")


# ---------------------------------------------------------------------------- timing
def time_eager(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median microseconds from the start of one eager call to the end of its GPU work (launch
    overhead included: the GPU idles while the host launches), starting from an idle GPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        samples.append(event_us(fn))
    return statistics.median(samples)


def time_graph(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median microseconds of one `fn()` replayed from a CUDA graph (bench_ll.capture_graph, after
    `warmup` eager calls that also compile the Triton kernels). The graph and its memory pool are freed
    on return."""
    return statistics.median(time_graphs_in_turn([fn], reps, warmup)[0])


def time_graphs_in_turn(fns: list[Callable[[], object]], reps: int, warmup: int = 2) -> list[list[float]]:
    """Microseconds of each `fn()` replayed from its own CUDA graph, the graphs replayed in turn (0, 1, ...,
    0, 1, ...): `reps` samples each, paired by round, so that clock and temperature drift reach every one
    alike and a difference of two is taken round by round. The graphs are freed on return."""
    release_memory()  # the eager calls' cached blocks, before the graphs take a pool of their own
    graphs = [capture_graph(fn, warmup, 1) for fn in fns]
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in graphs]
    for _ in range(reps):
        for graph, times in zip(graphs, samples):
            times.append(event_us(graph.replay))
    del graphs
    release_memory()
    return samples


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- weights
def random_fp8_weight(rows: int, cols: int, seed: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [rows, cols], float32 weight_scale_inv [ceil(rows/128), ceil(cols/128)]) with values
    ~1/sqrt(cols), made on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randn(rows, cols, device=device, generator=gen).mul_(FP8_CODE_SPREAD).clamp_(-448, 448)
    scale = torch.rand(num_blocks(rows), num_blocks(cols), device=device, generator=gen).add_(0.5)
    return codes.to(torch.float8_e4m3fn), scale.div_(FP8_CODE_SPREAD * cols ** 0.5)


def hf_tensors(shape: Shape, experts: range, device: torch.device, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A DeepSeek-V3 layer's `mlp.` tensors by their HF names: the router, the routed experts in `experts`
    and the shared experts, made one at a time (expert e's tensors are the same whichever rank asks)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, e = shape.hidden, shape.num_experts
    yield "gate.weight", (torch.randn(e, h, device=device, generator=gen) / h ** 0.5).to(torch.bfloat16)
    yield "gate.e_score_correction_bias", (torch.rand(e, device=device, generator=gen) - 0.5) * 0.1
    prefixes = [(f"experts.{i}", shape.intermediate, i) for i in experts]
    if shape.n_shared_experts:
        prefixes.append(("shared_experts", shape.intermediate * shape.n_shared_experts, e))
    for prefix, inter, index in prefixes:
        for p, projection in enumerate(PROJECTIONS):
            weight, scale = random_fp8_weight(*shape.proj_shape(projection, inter),
                                              seed + 1 + 3 * index + p, device)
            yield f"{prefix}.{projection}_proj.weight", weight
            yield f"{prefix}.{projection}_proj.weight_scale_inv", scale


def expert_weight_bytes(layer: FusedMoE) -> int:
    """Bytes one routed expert's GEMMs read: FP8 gate, up and down weights plus their float32 block scales."""
    w = layer.experts
    tensors = (w.gate_up, w.down, w.gate_up_scale, w.down_scale)
    return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------------------- the layers of one EP size
def new_layer(shape: Shape, buffer: Buffer, max_tokens: int, device: torch.device | str,
              expert_kernels: str = EXPERT_KERNELS) -> FusedMoE:
    return FusedMoE(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, None,
                    n_group=shape.n_group, topk_group=shape.topk_group,
                    routed_scaling_factor=shape.routed_scaling_factor, quant="fp8-block",
                    n_shared_experts=shape.n_shared_experts, buffer=buffer, max_tokens_per_rank=max_tokens,
                    expert_kernels=expert_kernels, device=device)


def reference_layer(layer: FusedMoE, shape: Shape, max_tokens: int) -> FusedMoE:
    """The same layer (sharing its weights, no copy) on the reference backend, for EP = 1."""
    ref = new_layer(shape, Buffer(None, low_latency_mode=True, backend="reference"), max_tokens, "meta")
    ref.load_state_dict(layer.state_dict(), assign=True)
    for name, buffer in layer.named_buffers(recurse=False):  # outside the state dict (the wait stats): its own
        if getattr(ref, name).is_meta:
            setattr(ref, name, torch.zeros_like(buffer))
    return ref


class EpLayers:
    """One layer per Buffer that `make_buffers(ep, bytes)` returns, each holding its Buffer's rank's experts,
    all on `device`: every EP rank here (emulated beyond 1), or one real rank per process
    (bench_moe_multigpu.py)."""

    def __init__(self, shape: Shape, ep: int, max_tokens: int, seed: int, device: torch.device,
                 make_buffers: Callable[[int, int], list[Buffer]], expert_kernels: str = EXPERT_KERNELS) -> None:
        self.shape, self.ep, self.max_tokens = shape, ep, max_tokens
        self.buffer_bytes = Buffer.get_low_latency_rdma_size_hint(max_tokens, shape.hidden, ep, shape.num_experts)
        self.layers: list[FusedMoE] = []
        per_rank = shape.num_experts // ep
        for buffer in make_buffers(ep, self.buffer_bytes):
            layer = new_layer(shape, buffer, max_tokens, device, expert_kernels)
            first = buffer.rank * per_rank
            layer.load_weights(hf_tensors(shape, range(first, first + per_rank), device, seed))
            self.layers.append(layer)
        self.expert_bytes = expert_weight_bytes(self.layers[0])

    def destroy(self) -> None:
        for layer in self.layers:
            layer.buffer.destroy()
        self.layers.clear()


def cuda_buffers(ep: int, size: int, comm_sms: str = "all") -> list[Buffer]:
    """EP = 1: one real rank's Buffer; more: ranks emulated on the current GPU, whose dispatch kernels size
    their grids for the rank's 1/EP of it (`comm_sms` "share") or for all of it ("all")."""
    if ep == 1:
        return [Buffer(None, num_rdma_bytes=size, low_latency_mode=True, backend="cuda")]
    return emulated_buffers(ep, size, gpu_share=ep if comm_sms == "share" else 1)


# ---------------------------------------------------------------------------- one (EP, T) point
class Case:
    """All ranks' tokens for one (EP, T) point, and closures that run one step of every rank: `depth`
    calls of each rank's layer in a row, as a model's MoE layers (one set of weights)."""

    def __init__(self, setup: EpLayers, tokens: int, seed: int, depth: int = 1) -> None:
        self.setup, self.layers, self.tokens, self.depth = setup, setup.layers, tokens, depth
        device = self.layers[0].gate_weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        h = setup.shape.hidden
        self.xs = [torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16) for _ in self.layers]
        self.routes = [layer.route(x) for layer, x in zip(self.layers, self.xs)]
        received = self.dispatch_all()
        self.recv = [(r[0], r[1]) for r in received]  # static inputs of the GEMM-only variant
        self.active_experts = sum(int((count > 0).sum()) for _, count in self.recv)
        routed = torch.unique(torch.cat([idx.flatten() for idx, _ in self.routes]))
        self.routed_experts = int((routed >= 0).sum())

    def dispatch_all(self) -> list[tuple]:
        """Every rank's dispatch send, then every receive: (recv_x, recv_count, handle) per rank. The rows
        are a packed copy (the GEMM-only variant's inputs must outlive later dispatches); the expert GEMMs'
        time is their weights', whether they read the rows there or in place."""
        sent = [layer.buffer.low_latency_dispatch(x, idx, self.setup.max_tokens, layer.num_experts,
                                                  use_fp8=layer.fp8, return_recv_hook=True)
                for layer, x, (idx, _) in zip(self.layers, self.xs, self.routes)]
        for s in sent:
            s[4]()
        return [s[:3] for s in sent]

    def plain(self, streams: CommStreams | None) -> list[torch.Tensor]:
        """The plain forward (as FusedMoE.forward runs it), its communication on `streams` (None: the
        current stream)."""
        return run_interleaved([chain_steps(layer, x, self.depth, streams) for layer, x in zip(self.layers, self.xs)])

    def sbo(self, streams: CommStreams | None) -> list[torch.Tensor]:
        """The single-batch overlap (FusedMoE(overlap="sbo")): each rank's combine sends an expert's rows as its
        down GEMM signals them."""
        return run_interleaved([chain_steps(layer, x, self.depth, streams, sbo=True)
                                for layer, x in zip(self.layers, self.xs)])

    def overlap(self, streams: CommStreams | None) -> list[torch.Tensor]:
        """The two-micro-batch schedule (as FusedMoE.forward_two_microbatches runs it), its communication on
        `streams` (None: the current stream)."""
        return forward_two_microbatches(self.layers, self.xs, streams, self.depth)

    def gemms(self) -> list[torch.Tensor]:
        """The routed experts' GEMMs alone, on every rank's received tokens."""
        return [layer.run_experts(x, count) for _ in range(self.depth)
                for layer, (x, count) in zip(self.layers, self.recv)]

    def communication(self, split: bool = False) -> list[torch.Tensor]:
        """A schedule with routing, shared and routed experts skipped: dispatch and combine only, of the
        whole batches or (`split`) of the two micro-batches."""
        inputs = zip(self.layers, self.xs, self.routes)
        if not split:
            return run_interleaved([self._communication_steps(layer, x, idx, w) for layer, x, (idx, w) in inputs])
        return run_interleaved([self._communication_steps(layer, *micro)
                                for layer, x, (idx, w) in inputs
                                for micro in zip(microbatches(x), microbatches(idx), microbatches(w))])

    def communication_beside_gemms(self, stream: torch.cuda.Stream) -> None:
        """The two micro-batches' communication on `stream` while the routed experts' GEMMs run on the
        current stream, with no dependency between them: how much of it the GPU hides under them alone."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.communication(split=True)
        self.gemms()
        torch.cuda.current_stream().wait_stream(stream)

    def _communication_steps(self, layer: FusedMoE, x: torch.Tensor, topk_idx: torch.Tensor,
                             topk_weights: torch.Tensor) -> Steps[torch.Tensor]:
        for _ in range(self.depth):
            _, _, handle, _, dispatch_hook = layer.buffer.low_latency_dispatch(
                x, topk_idx, self.setup.max_tokens, layer.num_experts,
                cumulative_local_expert_recv_stats=layer.expert_load, use_fp8=layer.fp8, return_recv_hook=True,
                rows_in_place=layer.rows_in_place(x.device))  # as the layer's dispatch
            yield DISPATCH_SENT
            dispatch_hook()
            # Zero-copy, as FusedMoE's combine: it reads whatever expert outputs its buffer holds.
            y = layer.buffer.get_next_low_latency_combine_buffer(handle)
            combined, _, combine_hook = layer.buffer.low_latency_combine(y, topk_idx, topk_weights, handle,
                                                                         zero_copy=True, return_recv_hook=True)
            yield COMBINE_SENT
            combine_hook()
        return combined


def relative_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all ranks' outputs."""
    g, w = torch.cat(got).float(), torch.cat(want).float()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


@dataclass
class Row:
    ep: int
    tokens: int
    experts: int  # routed experts that received at least one token (all ranks)
    ref_eager: float
    eager: float
    overlap_eager: float
    graph: float
    sbo_graph: float
    sbo_hidden: float  # median over rounds of graph - sbo_graph, the two replayed in turn
    overlap_graph: float
    one_stream_graph: float  # the two-micro-batch schedule with its communication on the compute stream
    hidden: float  # median over rounds of one_stream_graph - overlap_graph, the two replayed in turn
    gemm: float
    gemm_bytes: int
    comm_graph: float
    split_comm_graph: float  # the two micro-batches' dispatch + combine alone
    hideable: float  # gemm + split_comm_graph - the two run side by side without dependencies
    overlap_diff: float
    sbo_diff: float
    ref_diff: float
    predicted: Prediction  # the cost model's plain, sbo and dbo (ep_layer.moe.overlap), for all ranks
    auto: str  # what FusedMoE(overlap="auto") runs here

    def cells(self, copy_bw: float) -> list[str]:
        gemm_bw = self.gemm_bytes / (self.gemm * 1e-6)
        p = self.predicted
        values = [self.ep, self.tokens, self.experts, self.ref_eager, self.eager, self.overlap_eager, self.graph,
                  self.sbo_graph, self.overlap_graph, self.one_stream_graph, self.gemm, self.gemm_bytes / copy_bw * 1e6,
                  gemm_bw / 1e9, 100 * gemm_bw / copy_bw, self.comm_graph, self.split_comm_graph,
                  100 * self.sbo_hidden / self.comm_graph, 100 * self.hidden / self.split_comm_graph,
                  100 * self.hideable / self.split_comm_graph, p.none, p.sbo, p.dbo, self.auto,
                  self.sbo_diff, self.overlap_diff, self.ref_diff]
        return [format_cell(v) for v in values]


HEADER = ("EP", "T", "experts", "ref_eager", "eager", "ovl_eager", "graph", "sbo_graph", "ovl_graph", "ovl_1stream",
          "gemm", "gemm_floor", "gemm_GB/s", "%copy_bw", "comm", "comm_2mb", "sbo_hid%", "hid%", "hid_max%",
          "model", "model_sbo", "model_ovl", "auto", "sbo_diff", "ovl_diff", "ref_diff")


def format_cell(v: object) -> str:
    if isinstance(v, float):
        if v != v:  # NaN: not measured
            return "-"
        return f"{v:.2e}" if 0 < abs(v) < 0.01 else f"{v:.1f}"
    return str(v)


def measure(case: Case, setup: EpLayers, reps: Reps, reference: bool) -> Row:
    streams = CommStreams.new()
    plain_out = case.plain(streams)
    overlap_diff = relative_difference(case.overlap(streams), plain_out)
    sbo_diff = relative_difference(case.sbo(streams), plain_out)
    eager = time_eager(lambda: case.plain(streams), reps.eager)
    overlap_eager = time_eager(lambda: case.overlap(streams), reps.eager)
    graph_times, sbo_times = time_graphs_in_turn([lambda: case.plain(streams), lambda: case.sbo(streams)],
                                                 2 * reps.graph)
    sbo_hidden = statistics.median(plain - sbo for plain, sbo in zip(graph_times, sbo_times))
    overlap_times, one_stream_times = time_graphs_in_turn([lambda: case.overlap(streams), lambda: case.overlap(None)],
                                                          2 * reps.graph)
    hidden = statistics.median(one - side for one, side in zip(one_stream_times, overlap_times))
    comm_graph = time_graph(case.communication, reps.graph)
    gemm_times, split_comm_times, beside_times = time_graphs_in_turn(
        [case.gemms, lambda: case.communication(split=True), lambda: case.communication_beside_gemms(streams.dispatch)],
        reps.graph)
    hideable = statistics.median(g + c - b for g, c, b in zip(gemm_times, split_comm_times, beside_times))
    ref_eager = ref_diff = float("nan")
    if reference and setup.ep == 1 and case.depth == 1:
        ref = reference_layer(setup.layers[0], setup.shape, setup.max_tokens)
        ref_diff = relative_difference([ref(case.xs[0])], plain_out)
        ref_eager = time_eager(lambda: ref(case.xs[0]), reps.reference, warmup=1)
        del ref
    gemm_bytes = case.depth * case.active_experts * setup.expert_bytes
    layer, device = setup.layers[0], case.xs[0].device
    predicted, depth = layer.predict(case.tokens, device), case.depth
    return Row(setup.ep, case.tokens, case.active_experts, ref_eager, eager, overlap_eager,
               statistics.median(graph_times), statistics.median(sbo_times), sbo_hidden,
               statistics.median(overlap_times), statistics.median(one_stream_times), hidden,
               statistics.median(gemm_times), gemm_bytes, comm_graph, statistics.median(split_comm_times), hideable,
               overlap_diff, sbo_diff, ref_diff,
               Prediction(depth * predicted.none, depth * predicted.sbo, depth * predicted.dbo),
               layer.auto_schedule(case.tokens, device))


def print_table(rows: list[Row], copy_bw: float) -> None:
    print_cells(HEADER, [r.cells(copy_bw) for r in rows])


def print_cells(header: tuple[str, ...], cells: list[list[str]]) -> None:
    """A table with right-aligned columns separated by ' | '."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in cells:
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8], help="EP sizes (beyond 1: emulated)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per rank (default 1 32 128 256; --quick: 1 128; --smoke: 1 32)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="num_max_dispatch_tokens_per_rank, fixed for every T as a serving engine fixes it "
                             "(default: the largest --tokens)")
    parser.add_argument("--quick", action="store_true", help="fewer token counts and repetitions")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a tiny layer (H={SMOKE.hidden}, {SMOKE.num_experts} experts, I={SMOKE.intermediate}, "
                             f"top-{SMOKE.top_k}) to check that everything runs")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the reference backend (EP=1, eager)")
    parser.add_argument("--layers", type=int, default=1,
                        help="MoE layer calls per step, one after another as in a model (default 1)")
    parser.add_argument("--comm-sms", choices=["all", "share"], default="all",
                        help="emulated ranks' dispatch kernels size their grids for all of the GPU (default: their "
                             "kernels run one after another) or for the rank's 1/EP of it, the share of the "
                             "hardware it stands for")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = [1, 32] if args.smoke else [1, 128] if args.quick else [1, 32, 128, 256]
    if args.layers < 1:
        parser.error(f"--layers: expected at least 1, got {args.layers}")
    if min(args.tokens) < 1:
        parser.error(f"--tokens: expected positive token counts, got {args.tokens}")
    if args.max_tokens is None:
        args.max_tokens = max(args.tokens)
    shape = SMOKE if args.smoke else DEEPSEEK_V3
    for ep in args.ep:
        if not 1 <= ep <= MAX_RANKS or shape.num_experts % ep:
            parser.error(f"--ep: expected 1 to {MAX_RANKS} ranks dividing {shape.num_experts} experts, got {ep}")
    if not 1 <= args.max_tokens <= MAX_TOKENS_PER_RANK:
        parser.error(f"--max-tokens: expected 1 to {MAX_TOKENS_PER_RANK}, got {args.max_tokens}")
    if max(args.tokens) > args.max_tokens:
        parser.error(f"--tokens: expected at most --max-tokens={args.max_tokens}, got {args.tokens}")
    args.shape = shape
    args.reps = QUICK_REPS if args.quick else FULL_REPS
    return args


def main() -> None:
    args = parse_args()
    require_gpu()
    started = time.perf_counter()
    shape: Shape = args.shape
    copy_bw = copy_bandwidth()
    release_memory()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)")
    print(f"# H={shape.hidden} E={shape.num_experts} I={shape.intermediate} top-{shape.top_k} "
          f"n_group={shape.n_group} topk_group={shape.topk_group} shared={shape.n_shared_experts} FP8 block weights; "
          f"num_max_dispatch_tokens_per_rank={args.max_tokens}; {args.layers} layer call(s) per step")
    print(" ".join(HEADER), flush=True)
    rows = []
    for ep in args.ep:
        built = time.perf_counter()
        setup = EpLayers(shape, ep, args.max_tokens, args.seed, torch.device("cuda", torch.cuda.current_device()),
                         lambda ep, size: cuda_buffers(ep, size, args.comm_sms))
        torch.cuda.synchronize()
        print(f"# EP={ep}: {len(setup.layers)} layer(s) of {shape.num_experts // ep} experts made in "
              f"{time.perf_counter() - built:.1f} s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, buffer "
              f"{setup.buffer_bytes / 2**20:.0f} MiB per rank", flush=True)
        for tokens in args.tokens:
            case = Case(setup, tokens, seed=args.seed + 1000 * ep + tokens, depth=args.layers)
            if case.active_experts != case.routed_experts:
                print(f"# warning: EP={ep} T={tokens}: {case.active_experts} experts received tokens but "
                      f"routing chose {case.routed_experts}", flush=True)
            row = measure(case, setup, args.reps, args.reference)
            rows.append(row)
            del case
            release_memory()
            print(" ".join(row.cells(copy_bw)), flush=True)
        for layer in setup.layers:
            layer.buffer.check()
        print(f"# EP={ep}: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        setup.destroy()
        del setup
        release_memory()
        torch.cuda.reset_peak_memory_stats()
    print()
    print(f"Times in microseconds for all EP ranks together (EP > 1 emulated on one GPU) and {args.layers} layer "
          f"call(s), median of {args.reps.eager} eager calls or {args.reps.graph} graph replays ({2 * args.reps.graph} "
          "for graph and sbo_graph, and for ovl_graph and ovl_1stream, replayed in turn). experts = routed "
          "experts that got a token; ref_eager = reference backend (EP=1 only); eager/graph = cuda backend, plain "
          "schedule; sbo_graph = single-batch overlap (graph); ovl_* = two micro-batches, communication on side "
          "streams; ovl_1stream = the same all on one stream (graph); gemm = routed experts' GEMMs alone (CUDA "
          "graph); gemm_floor = their FP8 weights + block "
          "scales (experts that got a token) at the copy bandwidth; gemm_GB/s = those bytes / gemm; comm = "
          "dispatch + combine alone (graph), of the whole batches; comm_2mb = of the two micro-batches; sbo_hid% = "
          "(graph - sbo_graph, median of the rounds' differences) / comm; hid% = "
          "(ovl_1stream - ovl_graph, median of the rounds' differences) / comm_2mb: the share of its "
          "communication that the overlap hides; hid_max% = (gemm + comm_2mb - the two run side by side with no "
          "dependency) / comm_2mb: how much of it the GPU hides under the GEMMs alone; model, model_sbo, "
          "model_ovl = the cost model's plain, sbo and two-micro-batch times (ep_layer.moe.overlap); auto = what "
          "FusedMoE(overlap='auto') runs; sbo_diff, ovl_diff, ref_diff = relative difference of the single-batch, "
          "two-micro-batch and reference outputs from the plain one.")
    print_table(rows, copy_bw)
    print(f"# {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
