"""Low-latency dispatch/combine across real GPUs: one process per GPU, peers mapped over NVLink.

Each rank captures a CUDA graph of many back-to-back calls and all ranks replay it together (a
barrier first); the time per call is the slowest rank's replay time over the number of calls, so
the ranks' start skew is spread thin. Side by side: the reference backend over NCCL (eager), and
the NVLink bandwidth from GPU 0 to GPU 1 measured in the same run.

    python benchmarks/bench_ll_multigpu.py                  # all GPUs, T = 1 32 128 256, E = 256 288
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_ll import capture_graph, event_us  # this script's folder is on sys.path

from ep_layer import Buffer

CALLS_PER_GRAPH = 100


def dispatch_bytes_per_pair(hidden: int) -> int:
    return hidden + hidden // 128 * 4 + 16


def nvlink_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of one GPU-to-GPU copy (cuda:0 -> cuda:1), median of 10."""
    src = torch.randn(nbytes // 4, device="cuda:0")
    dst = torch.empty(nbytes // 4, device="cuda:1")
    samples = []
    for _ in range(12):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples[2:])


def graph_time(fn, group) -> float:
    """Microseconds per call: slowest rank's replay of CALLS_PER_GRAPH calls, median of 5 replays."""
    graph = capture_graph(fn, 3, CALLS_PER_GRAPH)
    torch.cuda.synchronize()
    samples = []
    for _ in range(6):
        dist.barrier(group=group)
        samples.append(event_us(graph.replay) / CALLS_PER_GRAPH)
    mine = torch.tensor([statistics.median(samples[1:])])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


def eager_time(fn, group) -> float:
    samples = []
    for _ in range(8):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples[2:])


def measure(rank: int, world: int, cpu_group, tokens: int, experts: int, args: argparse.Namespace) -> None:
    """Time one (T, E) point on every rank; rank 0 prints the row."""
    gen = torch.Generator(device="cuda").manual_seed(rank * 7919 + tokens)
    x = torch.randn(tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(args.topk, dim=1).indices
    w = torch.rand(tokens, args.topk, device="cuda", generator=gen)
    y = torch.randn(experts // world, world * tokens, args.hidden, device="cuda",
                    generator=gen).to(torch.bfloat16)
    size = Buffer.get_low_latency_rdma_size_hint(tokens, args.hidden, world, experts)
    buf = Buffer(cpu_group, 0, size, low_latency_mode=True, backend="cuda")
    state = {}

    def dispatch():
        state["handle"] = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)[2]

    disp = graph_time(dispatch, cpu_group)
    dispatch()
    handle = state["handle"]
    comb = graph_time(lambda: buf.low_latency_combine(y, idx, w, handle), cpu_group)
    buf.check()
    ref = Buffer(dist.group.WORLD, low_latency_mode=True, backend="reference")
    ref_disp = eager_time(lambda: ref.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True), cpu_group)
    ref_handle = ref.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)[2]
    ref_comb = eager_time(lambda: ref.low_latency_combine(y, idx, w, ref_handle), cpu_group)
    pairs = tokens * args.topk
    if rank == 0:
        print(f"{world} | {tokens} | {experts} | {pairs} | {disp:.1f} | {comb:.1f} | "
              f"{pairs * dispatch_bytes_per_pair(args.hidden) / disp / 1e3:.0f} | "
              f"{pairs * 2 * args.hidden / comb / 1e3:.0f} | {ref_disp:.0f} | {ref_comb:.0f}", flush=True)
    buf.destroy()


def run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    cpu_group = dist.new_group(backend="gloo")
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name()}, NVLink copy cuda:0 -> cuda:1 "
              f"{nvlink_bandwidth() / 1e9:.0f} GB/s; H={args.hidden} K={args.topk}", flush=True)
        print("EP | T | E | pairs/rank | disp_us | comb_us | disp_GB/s | comb_GB/s | ref_disp_us | ref_comb_us",
              flush=True)
    for experts in args.experts:
        for tokens in args.tokens:
            measure(rank, world, cpu_group, tokens, experts, args)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--experts", type=int, nargs="+", default=[256, 288])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--port", type=int, default=29555)
    args = parser.parse_args()
    if args.ranks < 2 or args.ranks > torch.cuda.device_count():
        raise SystemExit(f"--ranks: expected 2..{torch.cuda.device_count()} (one GPU per rank), got {args.ranks}")
    mp.spawn(run, args=(args.ranks, args.port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
