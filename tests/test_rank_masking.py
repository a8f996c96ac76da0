"""Rank masking (`Buffer(enable_shrink=True)`, DeepEP's fault tolerance) on CPU ranks, reference backend.

A rank's process dies (or hangs) between two rounds of dispatch and combine. The survivors' next call
waits for it at most `timeout_s`, then masks it instead of raising: nothing arrives from it, nothing is sent to it,
and a token routed to one of its experts combines as if that expert were -1; later calls do not wait
for it at all. Results are checked exactly against an oracle that leaves the dead rank out, and
`low_latency_query_mask_buffer` / `low_latency_update_mask_buffer` / `low_latency_clean_mask_buffer`
against what the survivors know. Without `enable_shrink` the same death is an error
(tests/test_reliability_buffer.py).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from ep_layer import Buffer

TIMEOUT_S = 3.0  # a live peer on a loaded 2-core machine must never look late
T, H, E, K = 6, 128, 8, 3


def inputs(world: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank's (x, topk_idx, topk_weights), the same on every rank: some -1 entries, some ranks
    with fewer tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rank in range(world):
        n = T - rank % 2
        x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
        idx[torch.rand(n, K, generator=gen) < 0.2] = -1
        out.append((x, idx, torch.rand(n, K, generator=gen)))
    return out


def expert_output(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert e scales its rows by (e + 1) / 8 (exact in bf16)."""
    return (rows.float() * ((expert + 1) / 8)).to(torch.bfloat16)


def check_dispatch(rank: int, world: int, every: list, live: set[int], recv_x: torch.Tensor,
                   recv_count: torch.Tensor) -> None:
    """Rows of each local expert: the live sources' tokens that chose it, by source then token."""
    num_local = E // world
    for local in range(num_local):
        expert = rank * num_local + local
        want = [x[t] for s, (x, idx, _) in enumerate(every) if s in live for t in range(len(x))
                if expert in idx[t].tolist()]
        assert int(recv_count[local]) == len(want), (rank, local, int(recv_count[local]), len(want))
        if want:
            assert torch.equal(recv_x[local, :len(want)], torch.stack(want)), (rank, local)


def expected_combine(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, world: int,
                     live: set[int]) -> torch.Tensor:
    """Float32 sum over k ascending of w * y(expert), experts of dead ranks left out, rounded once."""
    num_local = E // world
    acc = torch.zeros(len(x), H)
    for t in range(len(x)):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0 and e // num_local in live:
                acc[t] += weights[t, k] * expert_output(x[t], e).float()
    return acc.to(torch.bfloat16)


def one_round(buf: Buffer, rank: int, world: int, every: list, live: set[int]) -> float:
    """Dispatch, the experts, combine, all checked; returns the seconds the round took."""
    x, idx, weights = every[rank]
    start = time.monotonic()
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    check_dispatch(rank, world, every, live, recv_x, recv_count)
    num_local = E // world
    y = torch.zeros_like(recv_x)
    for local in range(num_local):
        n = int(recv_count[local])
        y[local, :n] = expert_output(recv_x[local, :n], rank * num_local + local)
    out, _, _ = buf.low_latency_combine(y, idx, weights, handle)
    took = time.monotonic() - start
    assert torch.equal(out, expected_combine(x, idx, weights, world, live)), rank
    return took


def mask_of(buf: Buffer, world: int) -> list[int]:
    status = torch.full((world,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def survive_a_dead_rank(rank: int, world: int, seed: int, dead: int, how: str) -> dict[str, float]:
    every = inputs(world, seed)
    buf = Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, backend="reference",
                 timeout_s=TIMEOUT_S)
    everyone = set(range(world))
    took = {"before": one_round(buf, rank, world, every, everyone)}
    assert mask_of(buf, world) == [0] * world
    if rank == dead:
        if how == "hangs":  # alive but never calls again: the survivors' waits run out
            time.sleep(4 * TIMEOUT_S + 2.0)
        os._exit(0)  # dies between two rounds, its connections torn down by the kernel
    live = everyone - {dead}
    took["first after"] = one_round(buf, rank, world, every, live)  # waits for the dead rank, then masks it
    assert mask_of(buf, world) == [int(r == dead) for r in range(world)]
    took["masked"] = one_round(buf, rank, world, every, live)  # does not wait for it again
    buf.low_latency_clean_mask_buffer()
    assert mask_of(buf, world) == [0] * world
    took["after clean"] = one_round(buf, rank, world, every, live)  # the dead rank is missed, and masked again
    assert mask_of(buf, world) == [int(r == dead) for r in range(world)]
    buf.low_latency_update_mask_buffer(dead, False)  # unmask by hand: the same as a clean
    assert mask_of(buf, world) == [0] * world
    buf.low_latency_update_mask_buffer(dead, True)  # mask by hand: no wait
    took["masked by hand"] = one_round(buf, rank, world, every, live)
    return took


@pytest.mark.parametrize("world,dead,how", [(2, 1, "dies"), (4, 2, "dies"), (4, 0, "dies"),
                                            pytest.param(4, 1, "hangs", marks=pytest.mark.slow)])
def test_survivors_mask_a_dead_rank_and_carry_on(world: int, dead: int, how: str, seed: int) -> None:
    took = run_ranks(survive_a_dead_rank, world, seed, dead, how, timeout_s=90, dies=(dead,))
    assert took[dead] is None
    for rank, t in enumerate(took):
        if rank == dead:
            continue
        # A call that misses the dead rank waits at most the timeout; once it is masked, none waits.
        assert t["first after"] <= TIMEOUT_S + 3.0 and t["after clean"] <= TIMEOUT_S + 3.0, (rank, t)
        assert t["masked"] < TIMEOUT_S / 2 and t["masked by hand"] < TIMEOUT_S / 2, (rank, t)
    print(f"world {world}, rank {dead} {how}: " + ", ".join(
        f"rank {r}: " + " / ".join(f"{k} {v:.2f} s" for k, v in t.items()) for r, t in enumerate(took) if t))


def test_mask_calls_need_enable_shrink_and_name_bad_arguments() -> None:
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    for call in (lambda: buf.low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int32)),
                 lambda: buf.low_latency_update_mask_buffer(0, True), buf.low_latency_clean_mask_buffer):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):
            call()
    shrinking = Buffer(None, low_latency_mode=True, enable_shrink=True, backend="reference")
    assert shrinking.enable_shrink and not buf.enable_shrink
    for bad in (torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), [0]):
        with pytest.raises(ValueError, match="mask_status"):
            shrinking.low_latency_query_mask_buffer(bad)
    for bad in (-1, 1, 0.0, True, "0"):
        with pytest.raises(ValueError, match="rank_to_mask"):
            shrinking.low_latency_update_mask_buffer(bad, True)

