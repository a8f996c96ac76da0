"""Fused MoE layer with real expert parallelism, one process per GPU (or all on one, --one-gpu): how much
of the dispatch/combine time single-batch overlap and two micro-batches hide when the other ranks really
run at the same time, beside what the cost model of ep_layer.moe.overlap predicts.

bench_moe.py emulates EP on one GPU, the ranks' work time-multiplexed on it. Here each of
EP ranks is a process on its own GPU holding E / EP experts (random FP8 block weights, DeepSeek-V3
shapes) and a cuda-backend Buffer whose peers are mapped through CUDA IPC; every rank routes its own
random T tokens (noaux_tc on random router weights, as bench_moe.py does). Per T and per rank:

    plain        FusedMoE.forward (dispatch send, shared expert, hook, routed GEMMs, combine)
    sbo          FusedMoE(overlap="sbo"): the combine sends each expert's rows as the down GEMM signals them
    overlap      FusedMoE.forward_two_microbatches (each half's communication under the other's compute)
    comm         dispatch + combine alone, plain schedule, same tokens, no expert compute
    compute      routing + shared expert + routed GEMMs on tokens received once beforehand, no communication
    compute_2mb  the same for the two micro-batches (what the overlap computes: expert weights read twice)

timed from CUDA-graph replay (each rank captures GRAPH_CALLS back-to-back calls; all ranks replay
together after a barrier; per-call time) and eagerly (one call after a barrier, from an idle GPU). A
time is the slowest rank's median. Derived, in % of comm:

    sbo_hid%    = (plain - sbo) / comm: what single-batch overlap saves
    hid%        = (plain - overlap) / comm: what the overlap saves, net of what splitting costs
    hid_ovl%    = (comm + compute_2mb - overlap) / comm: the share of comm that the overlapped layer hides
                  under its own compute (100: none of it shows)
    hid_plain%  = (comm + compute - plain) / comm: the same for the plain schedule (the shared expert
                  already runs while the dispatch travels)

and beside them the model's plain, sbo and two-micro-batch times (for the slowest rank) and what
FusedMoE(overlap="auto") runs.

--one-gpu puts every rank's process on GPU 0 (ranks sharing a GPU, as the multi-rank tests run them).
--cpu runs the same logic without GPUs (for CI): CPU processes over gloo, the reference backend,
PyTorch experts, the smoke shape, eager timing only.

    PYTHONPATH=. python3 benchmarks/bench_moe_multigpu.py --smoke        # tiny layer on all GPUs: run this first
    PYTHONPATH=. python3 benchmarks/bench_moe_multigpu.py                # DeepSeek-V3 shapes, T = 1 32 128 256
    PYTHONPATH=. python3 benchmarks/bench_moe_multigpu.py --ep 2 --tokens 128 --quick
    PYTHONPATH=. python3 benchmarks/bench_moe_multigpu.py --one-gpu --ep 4
    PYTHONPATH=. python3 benchmarks/bench_moe_multigpu.py --cpu          # 2 CPU ranks, no GPU needed
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_ll import capture_graph, copy_bandwidth, event_us  # this script's folder is on sys.path
from bench_moe import (
    DEEPSEEK_V3,
    EXPERT_KERNELS,
    SMOKE,
    Case,
    EpLayers,
    Shape,
    format_cell,
    print_cells,
    relative_difference,
    release_memory,
    require_gpu,
)

from ep_layer import Buffer
from ep_layer.checks import MAX_TOKENS_PER_RANK
from ep_layer.layout import MAX_RANKS
from ep_layer.moe import FusedMoE
from ep_layer.moe.experts import RecvX
from ep_layer.moe.layer import microbatches
from ep_layer.moe.overlap import Prediction

GRAPH_CALLS = 20  # layer calls per captured graph: spreads the ranks' start skew after the barrier thin
WARMUP = 2  # eager calls before timing (the first compiles the Triton kernels)
CPU_KERNELS = "torch"  # FusedMoE's expert_kernels for --cpu
VARIANTS = ("plain", "sbo", "overlap", "comm", "compute", "compute_2mb")


@dataclass(frozen=True)
class Reps:
    """Timed samples (each result is the median): eager calls, and replays of a GRAPH_CALLS-call graph."""

    eager: int
    replays: int


FULL_REPS = Reps(eager=20, replays=10)
QUICK_REPS = Reps(eager=5, replays=5)


# ---------------------------------------------------------------------------- timing across ranks
def eager_time(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """This rank's median microseconds of one eager call, every call started by all ranks together after a
    barrier, from an idle GPU (launch overhead included, as bench_moe.time_eager)."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            samples.append(event_us(fn))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def graph_time(fn: Callable[[], object], replays: int) -> float:
    """This rank's median microseconds per call of a CUDA graph of GRAPH_CALLS calls (captured with the
    case's static inputs), replayed by all ranks together after a barrier; the first replay is untimed.
    The graph and its memory pool are freed on return."""
    release_memory()  # the eager calls' cached blocks, before the graph takes a pool of its own
    graph = capture_graph(fn, WARMUP, GRAPH_CALLS)
    torch.cuda.synchronize()  # the warm-up calls, which talk to the other ranks, are done
    samples = []
    for _ in range(replays + 1):
        dist.barrier()
        samples.append(event_us(graph.replay) / GRAPH_CALLS)
    del graph
    release_memory()
    return statistics.median(samples[1:])


# ---------------------------------------------------------------------------- this rank's variants
def rank_buffer(cuda: bool, ep: int, size: int) -> list[Buffer]:
    """This process's one Buffer on the world group (EpLayers' make_buffers): cuda backend with peers over
    CUDA IPC, or the reference backend over gloo for --cpu."""
    if dist.get_world_size() != ep:
        raise ValueError(f"ep: expected the world size {dist.get_world_size()}, got {ep}")
    backend = "cuda" if cuda else "reference"
    return [Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, backend=backend)]


def received(layer: FusedMoE, x: torch.Tensor, max_tokens: int) -> tuple[RecvX, torch.Tensor]:
    """(recv_x, recv_count) of this rank's experts when every rank dispatches its `x` (all ranks call)."""
    topk_idx, _ = layer.route(x)
    recv_x, recv_count, _, _, hook = layer.buffer.low_latency_dispatch(
        x, topk_idx, max_tokens, layer.num_experts, use_fp8=layer.fp8, return_recv_hook=True)
    hook()
    return recv_x, recv_count


def compute_only(layer: FusedMoE, batches: list[tuple[torch.Tensor, RecvX, torch.Tensor]]
                 ) -> Callable[[], list[torch.Tensor]]:
    """A closure running, per (tokens, recv_x, recv_count) batch, what the layer computes without talking
    to the other ranks: routing, the shared expert and the routed experts' GEMMs."""
    def run() -> list[torch.Tensor]:
        outs = []
        for x, recv_x, recv_count in batches:
            layer.route(x)
            shared = layer.shared_expert(x)
            outs.append(layer.run_experts(recv_x, recv_count))
            if shared is not None:
                outs.append(shared)
        return outs
    return run


@dataclass
class RankResult:
    """One rank's measurements of one T (microseconds), gathered on rank 0."""

    eager: dict[str, float]
    graph: dict[str, float]
    gemm: float
    gemm_floor: float
    overlap_diff: float
    sbo_diff: float
    predicted: Prediction  # the cost model's times for this rank
    auto: str  # what FusedMoE(overlap="auto") runs here
    active_experts: int  # this rank's experts that received a token
    routed: list[bool]  # experts that this rank's tokens chose (global ids)


def measure_rank(setup: EpLayers, tokens: int, seed: int, reps: Reps, cuda: bool, copy_bw: float) -> RankResult:
    """Every variant of one T on this rank; all ranks call this together."""
    case = Case(setup, tokens, seed)
    layer, x = case.layers[0], case.xs[0]
    half_recv = [received(layer, h, setup.max_tokens) for h in microbatches(x)]
    streams = layer.comm_streams(x.device)  # as FusedMoE's forwards run them (None on CPU)
    variants = {
        "plain": lambda: case.plain(streams),
        "sbo": lambda: case.sbo(streams),
        "overlap": lambda: case.overlap(streams),
        "comm": case.communication,
        "compute": compute_only(layer, [(x, *case.recv[0])]),
        "compute_2mb": compute_only(layer, [(h, *r) for h, r in zip(microbatches(x), half_recv)]),
    }
    plain_out = case.plain(streams)
    overlap_diff = relative_difference(case.overlap(streams), plain_out)
    sbo_diff = relative_difference(case.sbo(streams), plain_out)
    eager = {name: eager_time(fn, reps.eager, cuda) for name, fn in variants.items()}
    graph = {name: graph_time(fn, reps.replays) for name, fn in variants.items()} if cuda else {}
    gemm = graph_time(case.gemms, reps.replays) if cuda else float("nan")
    routed = torch.zeros(setup.shape.num_experts, dtype=torch.bool)
    idx = case.routes[0][0].flatten().cpu()
    routed[idx[idx >= 0]] = True
    return RankResult(eager, graph, gemm, case.active_experts * setup.expert_bytes / copy_bw * 1e6, overlap_diff,
                      sbo_diff, layer.predict(tokens, x.device), layer.auto_schedule(tokens, x.device),
                      case.active_experts, routed.tolist())


# ---------------------------------------------------------------------------- the table (rank 0)
HEADER = ("EP", "T", "experts", "timing", *VARIANTS, "gemm", "gemm_floor", "sbo_hid%", "hid%", "hid_ovl%",
          "hid_plain%", "model", "model_sbo", "model_ovl", "auto", "sbo_diff", "ovl_diff")
NAN = float("nan")


def hidden(t: dict[str, float]) -> tuple[float, float, float, float]:
    """(sbo_hid%, hid%, hid_ovl%, hid_plain%) from one set of times (see the module docstring)."""
    comm = t["comm"]
    return (100 * (t["plain"] - t["sbo"]) / comm, 100 * (t["plain"] - t["overlap"]) / comm,
            100 * (comm + t["compute_2mb"] - t["overlap"]) / comm, 100 * (comm + t["compute"] - t["plain"]) / comm)


@dataclass
class Row:
    """One (T, timing) line: every time is the slowest rank's."""

    ep: int
    tokens: int
    experts: int  # routed experts that received at least one token (all ranks)
    timing: str  # "graph" or "eager"
    times: dict[str, float]
    gemm: float
    gemm_floor: float
    overlap_diff: float  # the largest over ranks
    sbo_diff: float  # the largest over ranks
    predicted: Prediction  # the slowest rank's
    auto: str  # "auto"'s choices over ranks (each rank chooses alone)
    per_rank_hidden: list[float]  # hid% from each rank's own times

    def cells(self) -> list[str]:
        p = self.predicted
        values = [self.ep, self.tokens, self.experts, self.timing, *(self.times[v] for v in VARIANTS),
                  self.gemm, self.gemm_floor, *hidden(self.times), p.none, p.sbo, p.dbo, self.auto, self.sbo_diff,
                  self.overlap_diff]
        return [format_cell(v) for v in values]


def rows_of(results: list[RankResult], ep: int, tokens: int) -> list[Row]:
    experts = sum(r.active_experts for r in results)
    diff, sbo_diff = max(r.overlap_diff for r in results), max(r.sbo_diff for r in results)
    predicted = max((r.predicted for r in results), key=lambda p: p.none)
    auto = "/".join(sorted({r.auto for r in results}))
    rows = []
    for timing in ("graph", "eager"):
        per_rank = [getattr(r, timing) for r in results]
        if not per_rank[0]:
            continue
        times = {v: max(t[v] for t in per_rank) for v in VARIANTS}
        graph = timing == "graph"
        rows.append(Row(ep, tokens, experts, timing, times, max(r.gemm for r in results) if graph else NAN,
                        max(r.gemm_floor for r in results) if graph else NAN, diff, sbo_diff, predicted, auto,
                        [hidden(t)[1] for t in per_rank]))
    return rows


LEGEND = (
    "Times in microseconds per layer call on one rank: the slowest rank's median of {eager} eager calls "
    "(timing=eager: all ranks start after a barrier, from an idle GPU) or of {replays} replays of a CUDA graph "
    "of {calls} calls (timing=graph: all ranks replay together after a barrier). experts = routed experts that "
    "got a token (all ranks); plain = FusedMoE.forward; sbo = FusedMoE(overlap='sbo'); overlap = "
    "forward_two_microbatches; comm = dispatch + "
    "combine alone (plain schedule, no expert compute); compute = routing + shared expert + routed GEMMs on "
    "tokens received beforehand (no communication); compute_2mb = the same for the two micro-batches; gemm = "
    "routed GEMMs alone; gemm_floor = the FP8 weights + block scales of that rank's experts that got a token "
    "at the copy bandwidth; sbo_hid% = (plain - sbo) / comm; hid% = (plain - overlap) / comm (what the overlap "
    "saves; negative: splitting "
    "costs more, e.g. reading the expert weights twice, than it hides); hid_ovl% = (comm + compute_2mb - "
    "overlap) / comm (the share of comm hidden under the overlapped layer's own compute); hid_plain% = "
    "(comm + compute - plain) / comm (the same for the plain schedule); model, model_sbo, model_ovl = the cost "
    "model's plain, sbo and two-micro-batch times (ep_layer.moe.overlap; the slowest rank's); auto = what "
    "FusedMoE(overlap='auto') runs; sbo_diff, ovl_diff = relative difference of the single-batch and "
    "two-micro-batch outputs from the plain one (largest over ranks).")


# ---------------------------------------------------------------------------- one rank's process
def run(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    """One EP rank: its device first, then the gloo group, the layer with its experts, every T."""
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(0 if args.one_gpu else rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        bench(rank, world, args, cuda)
    finally:
        dist.destroy_process_group()


def bench(rank: int, world: int, args: argparse.Namespace, cuda: bool) -> None:
    started = time.perf_counter()
    shape: Shape = args.shape
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    copy_bw = NAN
    if cuda:
        copy_bw = copy_bandwidth()
        release_memory()
    if rank == 0:
        print_header(world, shape, args, cuda, copy_bw)
    built = time.perf_counter()
    setup = EpLayers(shape, world, args.max_tokens, args.seed, device, partial(rank_buffer, cuda),
                     EXPERT_KERNELS if cuda else CPU_KERNELS)
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        memory = f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, " if cuda else ""
        print(f"# layer of {shape.num_experts // world} experts per rank made in {time.perf_counter() - built:.1f} s, "
              f"{memory}buffer {setup.buffer_bytes / 2**20:.0f} MiB per rank", flush=True)
        print(" ".join(HEADER), flush=True)
    rows = []
    for tokens in args.tokens:
        mine = measure_rank(setup, tokens, args.seed + 1000 * tokens + 7919 * rank, args.reps, cuda, copy_bw)
        results: list[RankResult | None] = [None] * world
        dist.all_gather_object(results, mine)
        release_memory()
        if rank == 0:
            rows += report(results, world, tokens)  # type: ignore[arg-type]
    setup.layers[0].buffer.check()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else NAN
    dist.barrier()  # no rank frees its buffer while a peer may still use it
    setup.destroy()
    dist.barrier()
    if rank == 0:
        if cuda:
            print(f"# peak {peak:.1f} GiB allocated on rank 0", flush=True)
        print()
        print(LEGEND.format(eager=args.reps.eager, replays=args.reps.replays, calls=GRAPH_CALLS))
        print_cells(HEADER, [r.cells() for r in rows])
        print(f"# {time.perf_counter() - started:.0f} s in all", flush=True)


def report(results: list[RankResult], world: int, tokens: int) -> list[Row]:
    """Rank 0: this T's rows, printed as they come, with each rank's hid% and a routing sanity check."""
    rows = rows_of(results, world, tokens)
    chosen = sum(any(r.routed[e] for r in results) for e in range(len(results[0].routed)))
    if rows[0].experts != chosen:
        print(f"# warning: T={tokens}: {rows[0].experts} experts received tokens but routing chose {chosen}",
              flush=True)
    for row in rows:
        print(" ".join(row.cells()), flush=True)
        print(f"#   T={tokens} {row.timing}: hid% per rank " +
              " ".join(format_cell(h) for h in row.per_rank_hidden), flush=True)
    return rows


def print_header(world: int, shape: Shape, args: argparse.Namespace, cuda: bool, copy_bw: float) -> None:
    placement = "all processes on GPU 0" if args.one_gpu else "one process per GPU"
    where = (f"{world} x {torch.cuda.get_device_name()} ({placement}, cuda backend over CUDA IPC), "
             f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)" if cuda else
             f"{world} CPU processes (gloo, reference backend, {CPU_KERNELS} experts)")
    print(f"# {where}; EP={world}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; command: {args.command}")
    print(f"# H={shape.hidden} E={shape.num_experts} I={shape.intermediate} top-{shape.top_k} "
          f"n_group={shape.n_group} topk_group={shape.topk_group} shared={shape.n_shared_experts} FP8 block weights; "
          f"num_max_dispatch_tokens_per_rank={args.max_tokens}; torch {torch.__version__}", flush=True)


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=None,
                        help="EP size = processes, one GPU each (default: all visible GPUs; --cpu: 2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per rank (default 1 32 128 256; --quick: 1 128; --smoke, --cpu: 1 32)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="num_max_dispatch_tokens_per_rank, fixed for every T (default: the largest --tokens)")
    parser.add_argument("--quick", action="store_true", help="fewer token counts and repetitions")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a tiny layer (H={SMOKE.hidden}, {SMOKE.num_experts} experts, I={SMOKE.intermediate}, "
                             f"top-{SMOKE.top_k}) to check that everything runs")
    parser.add_argument("--one-gpu", action="store_true",
                        help="every rank's process on GPU 0 (ranks sharing a GPU) instead of one GPU each")
    parser.add_argument("--cpu", action="store_true",
                        help="no GPU: CPU ranks over gloo, reference backend, PyTorch experts, tiny layer, eager only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.command = "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    small = args.smoke or args.cpu
    if args.tokens is None:
        args.tokens = [1, 32] if small else [1, 128] if args.quick else [1, 32, 128, 256]
    if min(args.tokens) < 1:
        parser.error(f"--tokens: expected positive token counts, got {args.tokens}")
    if args.max_tokens is None:
        args.max_tokens = max(args.tokens)
    if not 1 <= args.max_tokens <= MAX_TOKENS_PER_RANK:
        parser.error(f"--max-tokens: expected 1 to {MAX_TOKENS_PER_RANK}, got {args.max_tokens}")
    if max(args.tokens) > args.max_tokens:
        parser.error(f"--tokens: expected at most --max-tokens={args.max_tokens}, got {args.tokens}")
    args.shape = SMOKE if small else DEEPSEEK_V3
    if not args.cpu:
        require_gpu("bench_moe_multigpu.py")
    most = MAX_RANKS if args.cpu or args.one_gpu else min(MAX_RANKS, torch.cuda.device_count())
    if args.ep is None:
        args.ep = 2 if args.cpu else most
    if not 2 <= args.ep <= most or args.shape.num_experts % args.ep:
        where = "" if args.cpu or args.one_gpu else f" ({torch.cuda.device_count()} GPUs visible, one per rank)"
        parser.error(f"--ep: expected 2 to {most} ranks dividing {args.shape.num_experts} experts{where}, "
                     f"got {args.ep}")
    args.reps = QUICK_REPS if args.quick or args.cpu else FULL_REPS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_moe_multigpu_") as folder:
        mp.spawn(run, args=(args.ep, os.path.join(folder, "rendezvous"), args), nprocs=args.ep)


if __name__ == "__main__":
    main()
