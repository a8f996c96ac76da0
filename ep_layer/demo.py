"""End-to-end demo of `ep_layer.Buffer` on CPU: `python -m ep_layer.demo --help`.

Spawns several ranks (processes) that talk over gloo on 127.0.0.1, exactly as the ranks of an
expert-parallel MoE layer would: each rank routes its tokens to random experts, dispatches them to
the ranks owning those experts (bf16, then FP8), runs a stand-in expert computation on what it
received, and combines the expert outputs back. Every step is checked:

- dispatch: `recv_count` and the received rows match what the routing says, in (source rank, token)
  order; FP8 rows dequantise to the source tokens within FP8 precision;
- combine: the result matches a float64 weighted sum of the same expert outputs.

Rank 0 then prints a report (traffic, rows per expert, errors, time per call). The exit status is
non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_layer import Buffer
from ep_layer.quant import AMAX_FLOOR, FP8_GROUP, per_token_cast_back, per_token_cast_to_fp8


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ep_layer.demo",
        description="Run ep_layer's low-latency dispatch and combine across CPU ranks (gloo on 127.0.0.1)\n"
                    "with the reference backend, check the results, and print what happened.",
        epilog="examples:\n"
               "  python -m ep_layer.demo                       # 4 ranks, bf16 and FP8\n"
               "  python -m ep_layer.demo --ranks 2 --no-fp8    # 2 ranks, bf16 only\n"
               "  python -m ep_layer.demo --tokens 128 --hidden 7168 --experts 256 --topk 8"
               "   # DeepSeek-V3 sizes (slow on CPU)",
        formatter_class=_HelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="number of EP ranks (processes) to spawn")
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens per rank (also num_max_dispatch_tokens_per_rank, at most 1024)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 128 for FP8)")
    p.add_argument("--experts", type=int, default=32, help="global experts (a multiple of --ranks)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (1 to 16)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the FP8 dispatch (per-token, per-128-channel scales)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per mode (after one warm-up)")
    p.add_argument("--seed", type=int, default=0, help="random seed for tokens and routing")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any rank waits for a peer")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if not 1 <= args.tokens <= 1024:
        p.error("--tokens must be in 1..1024")
    if args.experts < args.ranks or args.experts % args.ranks:
        p.error(f"--experts ({args.experts}) must be a positive multiple of --ranks ({args.ranks})")
    if not 1 <= args.topk <= min(16, args.experts):
        p.error(f"--topk must be in 1..{min(16, args.experts)}")
    if args.hidden < 1 or (args.fp8 and args.hidden % FP8_GROUP):
        p.error(f"--hidden must be positive, and a multiple of {FP8_GROUP} with --fp8 (or pass --no-fp8)")
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (rank 0's store will take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_scale(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each expert's stand-in "weights": one float32 factor, different for every expert."""
    return (1.0 + experts.double() / num_experts).float()


def expert_forward(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stand-in for an expert MLP: float32 in, bf16 out. Scaling by a factor unique to the expert
    makes a row that reached the wrong expert show up as a wrong combine result."""
    return (rows.float() * scale).to(torch.bfloat16)


def row_bytes(hidden: int, use_fp8: bool) -> int:
    """Payload bytes of one token: bf16 row, or fp8 row plus one float32 scale per 128 channels."""
    return hidden + 4 * (hidden // FP8_GROUP) if use_fp8 else 2 * hidden


def run_mode(buf: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             all_x: torch.Tensor, all_idx: torch.Tensor, args: argparse.Namespace, use_fp8: bool) -> dict:
    """Dispatch + expert compute + combine `1 + iters` times; check the last; return stats."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_local = args.experts // num_ranks
    times: dict[str, list[float]] = {"dispatch": [], "hook": [], "combine": []}

    for _ in range(1 + args.iters):
        dist.barrier()  # start together, so the times measure the exchange, not rank skew
        t0 = time.perf_counter()
        # Send half only: returns at once; the hook runs the receive half. A serving engine runs
        # other work (the other micro-batch, the shared expert) in between.
        recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, topk_idx, args.tokens, args.experts, use_fp8=use_fp8, return_recv_hook=True)
        t1 = time.perf_counter()
        hook()
        t2 = time.perf_counter()

        # Expert compute on the received rows: [E_l, R*T, H] with the first recv_count[l] rows valid.
        inputs = per_token_cast_back(*recv_x) if use_fp8 else recv_x.float()
        expert_out = torch.zeros(num_local, num_ranks * args.tokens, args.hidden, dtype=torch.bfloat16)
        for local in range(num_local):
            n = int(recv_count[local])
            scale = expert_scale(torch.tensor(rank * num_local + local), args.experts)
            expert_out[local, :n] = expert_forward(inputs[local, :n], scale)

        dist.barrier()
        t3 = time.perf_counter()
        combined, _, _ = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
        t4 = time.perf_counter()
        for key, seconds in (("dispatch", t1 - t0), ("hook", t2 - t1), ("combine", t4 - t3)):
            times[key].append(seconds)

    failures = []

    # Check dispatch: for each local expert, the rows are the (source rank, token) pairs routed to
    # it, ordered by source rank, then token.
    for local in range(num_local):
        expert = rank * num_local + local
        src_rank, src_token = (all_idx == expert).any(dim=2).nonzero(as_tuple=True)  # row-major order
        n = int(recv_count[local])
        if n != len(src_token):
            failures.append(f"expert {expert}: recv_count {n}, expected {len(src_token)}")
            continue
        if not torch.equal(handle[0][local, :n].long(), src_token):
            failures.append(f"expert {expert}: src_info does not list the source tokens in order")
        expected = all_x[src_rank, src_token].float()
        if use_fp8:  # FP8 keeps 3 mantissa bits: error at most 1/16 of the group's largest value
            err = (inputs[local, :n] - expected).abs().view(n, -1, FP8_GROUP).amax(dim=2)
            bound = expected.abs().view(n, -1, FP8_GROUP).amax(dim=2).clamp_min(AMAX_FLOOR) / 16
            if bool((err > bound * 1.001).any()):
                failures.append(f"expert {expert}: FP8 rows are off by more than FP8 precision")
        elif not torch.equal(inputs[local, :n], expected):
            failures.append(f"expert {expert}: received rows differ from the source tokens")

    # Check combine against float64: sum over k of weight * expert output, with the expert applied
    # to exactly what the expert saw (the FP8 round trip of the token, or the bf16 token).
    seen = per_token_cast_back(*per_token_cast_to_fp8(x)) if use_fp8 else x.float()
    outputs = expert_forward(seen.unsqueeze(1), expert_scale(topk_idx, args.experts).unsqueeze(2))
    terms = topk_weights.double().unsqueeze(2) * outputs.double()
    reference = terms.sum(dim=1)
    err = (combined.double() - reference).abs()
    # One bf16 rounding of the result (2^-8 relative) plus float32 accumulation error.
    bound = reference.abs() * 2.0 ** -8 + terms.abs().sum(dim=1) * 2.0 ** -20
    if bool((err > bound).any()):
        failures.append(f"combine differs from the float64 weighted sum by up to {float(err.max()):.3g}")

    counts = recv_count.tolist()
    dests = (topk_idx // num_local).tolist()
    copies = sum(len(set(d)) for d in dests)  # token travels once to each rank it has experts on
    return {
        "recv_count": counts,
        "token_copies": copies,
        "dispatch_bytes": copies * row_bytes(args.hidden, use_fp8),
        "combine_bytes": sum(counts) * 2 * args.hidden,  # one bf16 row back per (token, expert)
        "combine_err": float(err.max()),
        "combine_rel_err": float(err.max() / reference.abs().max().clamp_min(1e-30)),
        "ms": {key: 1e3 * statistics.median(v[1:]) for key, v in times.items()},
        "failures": failures,
    }


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One EP rank. Rank 0 prints the report and exits non-zero if any rank's check failed."""
    torch.set_num_threads(1)  # several ranks share few cores
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback whatever the hostname says
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=args.timeout))
    buf = Buffer(dist.group.WORLD, low_latency_mode=True, backend="reference", timeout_s=args.timeout)

    # This rank's tokens and random routing: top-k distinct experts per token, weights summing to 1.
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
    topk_idx = torch.rand(args.tokens, args.experts, generator=gen).topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, generator=gen) + 0.1
    topk_weights /= topk_weights.sum(dim=1, keepdim=True)

    # Every rank's tokens and routing, to know what each expert should receive (bf16 travels as bytes).
    all_x = torch.empty(args.ranks, args.tokens, 2 * args.hidden, dtype=torch.uint8)
    dist.all_gather(list(all_x.unbind(0)), x.view(torch.uint8))
    all_idx = torch.empty(args.ranks, args.tokens, args.topk, dtype=torch.int64)
    dist.all_gather(list(all_idx.unbind(0)), topk_idx)

    stats = {"bf16": run_mode(buf, x, topk_idx, topk_weights, all_x.view(torch.bfloat16), all_idx, args,
                              use_fp8=False)}
    if args.fp8:
        stats["fp8"] = run_mode(buf, x, topk_idx, topk_weights, all_x.view(torch.bfloat16), all_idx, args,
                                use_fp8=True)

    gathered: list[dict | None] = [None] * args.ranks
    dist.all_gather_object(gathered, stats)
    buf.destroy()
    dist.destroy_process_group()
    if rank == 0:
        ok = report(args, port, gathered)
        if not ok:
            sys.exit(1)


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def report(args: argparse.Namespace, port: int, per_rank: list) -> bool:
    """Print what every rank did; return True if every check passed."""
    modes = list(per_rank[0])
    num_local = args.experts // args.ranks
    print(f"\nep-layer demo: {args.ranks} CPU ranks over gloo on 127.0.0.1:{port}, Buffer backend=reference")
    print(f"  T={args.tokens} tokens/rank  H={args.hidden}  E={args.experts} experts ({num_local} per rank)  "
          f"top-k={args.topk}  modes: {', '.join(modes)}")

    print("\nBytes each rank sends (payload only; a token travels once to each rank hosting one of its "
          "experts,\nand each received row goes back once in combine)")
    head = f"  {'rank':>4}  {'tokens sent':>11}  {'token copies':>12}"
    head += "".join(f"  {'dispatch ' + m:>13}" for m in modes) + f"  {'rows recv':>9}  {'combine':>12}"
    print(head)
    for r, s in enumerate(per_rank):
        first = s[modes[0]]
        line = f"  {r:>4}  {args.tokens:>11}  {first['token_copies']:>12}"
        line += "".join(f"  {kib(s[m]['dispatch_bytes']):>13}" for m in modes)
        line += f"  {sum(first['recv_count']):>9}  {kib(first['combine_bytes']):>12}"
        print(line)

    print("\nRows received per local expert (recv_count; global expert id = rank * E_l + local)")
    for r, s in enumerate(per_rank):
        counts = s[modes[0]]["recv_count"]
        print(f"  rank {r}: " + " ".join(f"e{r * num_local + i}={c}" for i, c in enumerate(counts)))

    print("\nChecks (dispatch rows and order, combine vs float64 weighted sum)")
    ok = True
    for m in modes:
        fails = [f"rank {r}: {f}" for r, s in enumerate(per_rank) for f in s[m]["failures"]]
        ok &= not fails
        err = max(s[m]["combine_err"] for s in per_rank)
        rel = max(s[m]["combine_rel_err"] for s in per_rank)
        print(f"  {m:>4}: {'PASS' if not fails else 'FAIL'}  combine max error {err:.3g} "
              f"({rel:.2g} of the largest output)")
        for f in fails[:10]:
            print(f"        {f}")

    print(f"\nWall time per call, ms (median of {args.iters}, slowest rank)")
    print(f"  {'mode':>4}  {'dispatch send':>13}  {'dispatch hook':>13}  {'combine':>9}")
    for m in modes:
        ms = {k: max(s[m]["ms"][k] for s in per_rank) for k in ("dispatch", "hook", "combine")}
        print(f"  {m:>4}  {ms['dispatch']:>13.2f}  {ms['hook']:>13.2f}  {ms['combine']:>9.2f}")
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    start = time.perf_counter()
    try:
        mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)
    except mp.ProcessExitedException as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as e:
        print(f"demo FAILED: a rank raised an exception:\n{e}", file=sys.stderr)
        return 1
    print(f"({args.ranks} rank(s), {time.perf_counter() - start:.1f} s including process start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
