"""High-throughput (normal-mode) dispatch and combine benchmark: our CUDA kernels vs the copy floor (and, at
EP = 1, vs the reference backend), for prefill-sized batches.

EP = 1 is one Buffer; more ranks are emulated on one GPU (ep_layer.emulation), each rank's kernels on a
stream of its own, side by side, each rank taking its share of the SMs (at most `--num-sms`, DeepEP's 20
by default): a time covers the work of all ranks together. Each rank has T tokens (H = 7168, top-8 of
E = 256 experts; bf16 rows, or e4m3 rows with float32 scales per 128 values). `--transport nvshmem` puts the
EP = 1 Buffer on NVSHMEM's heap, `nvshmem-gets` also reads its one rank with NVSHMEM gets (the path of a peer
on another node).
- `disp_us`: a dispatch sized by `num_worst_tokens` (no host wait), median of CUDA-graph replays;
- `comb_us`: a combine of the received rows, median of CUDA-graph replays; `zc_us`: the same combine of
  rows already written where it stages them (Buffer.get_next_combine_buffer, as FusedMoE writes them);
- `floor_us`: one copy of the rows all ranks receive (read + written) at the copy rate measured in this
  run; `recv_GB/s`: those bytes over the dispatch time, as DeepEP counts its bandwidth;
- `sync_us` (EP = 1): the usual dispatch, which waits for the host to count its rows (eager wall time);
- `ref_*` (EP = 1, bf16): the reference backend on the GPU (eager; it synchronises).

With `--processes` each EP > 1 runs instead as that many processes (one per GPU while there are GPUs
enough, else several on one GPU, which then share it by time slices), each with a Buffer over a gloo
group and the peers' buffers mapped through CUDA IPC: eager wall times of the slowest rank (medians),
and each rank's received bytes over the dispatch time beside the copy rate to a peer GPU (or within
the GPU when there is one).

    python benchmarks/bench_ht.py                            # EP = 1, 2, 4, 8 at 4096 tokens per rank
    python benchmarks/bench_ht.py --ep 1 --tokens 1024 8192 --num-sms 20 132
    python benchmarks/bench_ht.py --ep 2 4 8 --processes     # IPC processes
    python benchmarks/bench_ht.py --ep 1 --transport nvshmem-gets  # EP = 1 on NVSHMEM, read by gets
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_ll import copy_bandwidth, print_table, time_graph
from bench_ll_multigpu import eager_time, nvlink_bandwidth

from ep_layer import Buffer
from ep_layer.backends import nvshmem_heap
from ep_layer.emulation import RankStreams, emulated_buffers
from ep_layer.layout import normal_buffer_bytes, row_stride, stage_bytes

HEADER = ("EP", "T", "fmt", "sms", "disp_us", "comb_us", "zc_us", "floor_us", "disp/floor", "comb/floor", "zc/floor",
          "recv_GB/s", "nvl_MiB", "sync_us", "ref_disp_us", "ref_comb_us")


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def wall_us(fn, calls: int = 20) -> float:
    """Median eager wall time of one call, synchronised before and after."""
    samples = []
    for _ in range(calls + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples[3:])


class Rank:
    """One rank's inputs, their layout and a first dispatch's outputs."""

    def __init__(self, buf: Buffer, rank: int, tokens: int, hidden: int, experts: int, topk: int, fp8: bool,
                 worst: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(rank * 1000 + tokens)
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        self.x = (x.to(torch.float8_e4m3fn), torch.rand(tokens, hidden // 128, device="cuda", generator=gen)) if fp8 \
            else x
        idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
        self.buf, self.worst = buf, worst
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        self.kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=idx, topk_weights=torch.rand(tokens, topk, device="cuda", generator=gen))
        self.sent = int(in_rank.sum())  # rows this rank sends; summed over the ranks, the rows received

    def first_dispatch(self) -> None:
        recv = self.buf.dispatch(self.x, num_worst_tokens=self.worst, **self.kwargs)
        self.handle, self.recv_weights = recv[4], recv[2]
        rows = recv[0] if isinstance(recv[0], torch.Tensor) else recv[0][0]
        self.y = torch.randn(rows.shape, device="cuda").to(torch.bfloat16)
        self.buf.get_next_combine_buffer(self.handle, rows.shape[1]).copy_(self.y)  # what combine_in_place reads

    def dispatch_sized(self) -> None:
        self.buf.dispatch(self.x, num_worst_tokens=self.worst, **self.kwargs)

    def dispatch_waiting(self) -> None:
        self.buf.dispatch(self.x, **self.kwargs)

    def combine(self) -> None:
        self.buf.combine(self.y, self.handle, topk_weights=self.recv_weights)

    def combine_in_place(self) -> None:
        rows = self.buf.get_next_combine_buffer(self.handle, self.y.shape[1])
        self.buf.combine(rows, self.handle, topk_weights=self.recv_weights)


def nvl_bytes(tokens: int, hidden: int, topk: int, ep: int) -> int:
    """A normal-mode buffer that stages `tokens` bf16 rows with their top-k ids and weights (the larger of a
    dispatch's and a combine's halves), among `ep` ranks."""
    half = max(stage_bytes(tokens, row_stride(2 * hidden, 0, 8 * topk, 4 * topk), ep),
               stage_bytes(ep * tokens, 2 * hidden, 4 * topk))
    return normal_buffer_bytes(half)


def reference_times(tokens: int, hidden: int, experts: int, topk: int) -> tuple[float, float]:
    ref = Buffer(None, num_nvl_bytes=1 << 20, low_latency_mode=False, backend="reference")
    r = Rank(ref, 0, tokens, hidden, experts, topk, False, 0)
    recv = ref.dispatch(r.x, **r.kwargs)
    r.handle, r.recv_weights, r.y = recv[4], recv[2], recv[0]
    return wall_us(r.dispatch_waiting, 5), wall_us(r.combine, 5)


def measure(ep: int, tokens: int, args: argparse.Namespace, fp8: bool, sms: int, rate: float) -> tuple:
    h, e, k = args.hidden, args.experts, args.topk
    Buffer.set_num_sms(sms)
    size = nvl_bytes(tokens, h, k, ep)
    if ep == 1:
        transport = "nvshmem" if args.transport.startswith("nvshmem") else "ipc"
        os.environ[nvshmem_heap.FORCE_PUTS] = "1" if args.transport == "nvshmem-gets" else "0"
        bufs = [Buffer(None, num_nvl_bytes=size, low_latency_mode=False, backend="cuda", transport=transport)]
    else:
        bufs = emulated_buffers(ep, 0, gpu_share=ep, num_nvl_bytes=size)
    ranks = [Rank(b, r, tokens, h, e, k, fp8, ep * tokens) for r, b in enumerate(bufs)]
    streams = RankStreams(ep) if ep > 1 else None

    def each(method: str):
        calls = [getattr(r, method) for r in ranks]
        return (lambda: streams.run(calls)) if streams else calls[0]

    each("first_dispatch")()
    torch.cuda.synchronize()
    disp, in_place = time_graph(each("dispatch_sized")), time_graph(each("combine_in_place"))
    comb = time_graph(each("combine"))
    received = sum(r.sent for r in ranks)
    row = h if fp8 else 2 * h
    floor = 2 * received * row / rate * 1e6
    sync = wall_us(ranks[0].dispatch_waiting) if ep == 1 else float("nan")
    refs = reference_times(tokens, h, e, k) if ep == 1 and not fp8 and not args.no_reference else (float("nan"),) * 2
    for b in bufs:
        b.check()
        b.destroy()
    bf16_floor = floor * (2 * h) / row
    return (ep, tokens, "fp8" if fp8 else "bf16", min(sms, _sms() // ep), disp, comb, in_place, floor, disp / floor,
            comb / bf16_floor, in_place / bf16_floor, received * row / disp / 1e3, size / 2**20, sync, *refs)


PROCESS_HEADER = ("EP", "T", "fmt", "GPUs", "disp_us", "comb_us", "zc_us", "recv_GB/s/rank", "copy_GB/s")


def peer_copy_rate() -> float:
    """Bytes/s of one copy to the next GPU (or within this one, when it is alone), bytes read counted once."""
    return nvlink_bandwidth() if torch.cuda.device_count() > 1 else copy_bandwidth() / 2


def slowest_wall_us(fn, group: object) -> float:
    """The slowest rank's median eager wall time of one call, the ranks started together."""
    mine = torch.tensor([eager_time(fn, group)])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


def process_rank(rank: int, world: int, port: int, args: argparse.Namespace, rate: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    Buffer.set_num_sms(max(args.num_sms))
    for tokens in args.tokens:
        for fp8 in (False, True):
            size = nvl_bytes(tokens, args.hidden, args.topk, world)
            buf = Buffer(group, num_nvl_bytes=size, low_latency_mode=False, backend="cuda")
            r = Rank(buf, rank, tokens, args.hidden, args.experts, args.topk, fp8, world * tokens)
            r.first_dispatch()
            received = int(r.handle.recv_src_rank.ge(0).sum())
            disp = slowest_wall_us(r.dispatch_sized, group)
            zero_copy = slowest_wall_us(r.combine_in_place, group)
            comb = slowest_wall_us(r.combine, group)
            row = args.hidden if fp8 else 2 * args.hidden
            per_rank = torch.tensor([received * row / disp / 1e3])
            dist.all_reduce(per_rank, group=group)
            buf.check()
            buf.destroy()
            if rank == 0:
                print(" | ".join(str(v) for v in (world, tokens, "fp8" if fp8 else "bf16",
                                                   min(world, torch.cuda.device_count()), f"{disp:.1f}",
                                                   f"{comb:.1f}", f"{zero_copy:.1f}", f"{float(per_rank) / world:.0f}",
                                                   f"{rate / 1e9:.0f}")), flush=True)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main_processes(args: argparse.Namespace) -> None:
    rate = peer_copy_rate()
    print(f"# IPC processes on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}; H={args.hidden} "
          f"E={args.experts} top-{args.topk}, {max(args.num_sms)} SMs a call", flush=True)
    print(" | ".join(PROCESS_HEADER), flush=True)
    for i, ep in enumerate(e for e in args.ep if e > 1):
        mp.spawn(process_rank, args=(ep, args.port + i, args, rate), nprocs=ep)
    print("eager wall time of the slowest rank; recv_GB/s/rank: a rank's received rows over the dispatch time, "
          "averaged over the ranks; copy_GB/s: one copy to the next GPU (within the GPU when there is one)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, nargs="+", default=[20], help="Buffer.set_num_sms values (even)")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference backend's columns")
    parser.add_argument("--processes", action="store_true", help="EP > 1 as IPC processes instead of emulated")
    parser.add_argument("--port", type=int, default=29575, help="with --processes: the first rendezvous port")
    parser.add_argument("--transport", choices=("ipc", "nvshmem", "nvshmem-gets"), default="ipc",
                        help="the EP = 1 Buffer's memory: cudaMalloc (ipc) or NVSHMEM's symmetric heap, its rank "
                             "read by loads and stores or (nvshmem-gets) by NVSHMEM gets")
    args = parser.parse_args()
    if args.transport != "ipc" and (args.processes or args.ep != [1]):
        parser.error("--transport: NVSHMEM is measured at --ep 1 only (one process)")
    if args.processes:
        main_processes(args)
        return
    rate = copy_bandwidth()
    print(f"# H={args.hidden} E={args.experts} top-{args.topk}, copy rate {rate / 1e12:.2f} TB/s (read + written)",
          flush=True)
    rows = []
    for ep in args.ep:
        for tokens in args.tokens:
            for fp8 in (False, True):
                for sms in sorted({min(s, _sms() // ep) if ep > 1 else s for s in args.num_sms}):
                    rows.append(measure(ep, tokens, args, fp8, sms + sms % 2, rate))
                    print(" ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    print()
    print_table(HEADER, rows)
    print("comb/floor, zc/floor: against the bf16 rows' floor (a combine sends bf16 rows back whatever the dispatch "
          "sent)")


if __name__ == "__main__":
    main()
