"""Where the host time of an eager low-latency call goes, in the setting of DeepEP's own benchmark
(tests/test_low_latency.py: torch.set_default_device('cuda'), bfloat16 default dtype, the receive-count
stats tensor, FP8 dispatch, no hook): host microseconds per call (median of many, launches only), then
cProfile's top functions over the same calls.

    python benchmarks/profile_eager.py                       # T = 128, H = 7168, E = 288, top-8, EP = 1
    python benchmarks/profile_eager.py --tokens 1 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from bench_ll import host_time

from ep_layer import Buffer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--top", type=int, default=20, help="functions to list from cProfile")
    args = p.parse_args()

    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    t, h, e = args.tokens, args.hidden, args.experts
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(t, h, 1, e), low_latency_mode=True,
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
    rows = [("dispatch", host_time(dispatch, args.calls)), ("combine", host_time(combine, args.calls))]

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        dispatch()
        combine()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    print(f"{torch.cuda.get_device_name()}, T = {t}, H = {h}, E = {e}, top-{args.topk}, EP = 1, default device "
          f"cuda, bf16 default dtype, stats tensor")
    print(f"{'call':10s} {'host us':>8s}")
    for name, us in rows:
        print(f"{name:10s} {us:8.1f}")


if __name__ == "__main__":
    main()
