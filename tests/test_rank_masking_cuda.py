"""Rank masking (`Buffer(enable_shrink=True)`) in the cuda backend's kernels, on one GPU (skipped without).

Emulated ranks in one process, one of which stops calling, and processes mapped through CUDA IPC, one of
which is killed: the survivors' kernels wait for the missing rank at most `timeout_s`, mask it on the
device instead of recording a timeout, and go on without it; later calls do not wait for it. Results
are checked exactly against the same oracle as the reference backend's masking test
(tests/test_rank_masking.py), which leaves the missing rank out.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_rank_masking import E, H, T, check_dispatch, expected_combine, expert_output, inputs

from ep_layer import Buffer, EPTimeoutError, native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built"),
]

TIMEOUT_S = 1.0


def on_gpu(every: list) -> list:
    return [tuple(t.cuda() for t in rank) for rank in every]


def experts(recv_x: torch.Tensor, recv_count: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    y = torch.zeros_like(recv_x)
    for local, n in enumerate(recv_count.tolist()):
        y[local, :n] = expert_output(recv_x[local, :n], rank * num_local + local)
    return y


def emulated_round(buffers: list[Buffer], ranks: list[int], every: list, live: set[int]) -> float:
    """One dispatch and combine by `ranks` only (every send, then every hook: one stream), checked
    exactly against the oracle of the `live` ranks; the seconds it took."""
    world = len(buffers)
    num_local = E // world
    start = time.monotonic()
    sent = {r: buffers[r].low_latency_dispatch(every[r][0], every[r][1], T, E, use_fp8=False, return_recv_hook=True)
            for r in ranks}
    for r in ranks:
        sent[r][4]()
    combined = {r: buffers[r].low_latency_combine(experts(sent[r][0], sent[r][1], r, num_local), every[r][1],
                                                  every[r][2], sent[r][2], return_recv_hook=True) for r in ranks}
    for r in ranks:
        combined[r][2]()
    torch.cuda.synchronize()
    took = time.monotonic() - start
    every_cpu = [tuple(t.cpu() for t in rank) for rank in every]
    for r in ranks:
        buffers[r].check()  # no timeout is recorded: the missing rank is masked instead
        check_dispatch(r, world, every_cpu, live, sent[r][0].cpu(), sent[r][1].cpu())
        x, idx, weights = every_cpu[r]
        assert torch.equal(combined[r][0].cpu(), expected_combine(x, idx, weights, world, live)), r
    return took


def mask_of(buf: Buffer) -> list[int]:
    status = torch.full((buf.group_size,), 7, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def test_emulated_ranks_mask_a_rank_that_stops_calling(seed: int) -> None:
    from ep_layer.emulation import emulated_buffers

    world, quiet = 4, 2
    size = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buffers = emulated_buffers(world, size, TIMEOUT_S, shrink=True)
    every = on_gpu(inputs(world, seed))
    everyone = list(range(world))
    emulated_round(buffers, everyone, every, set(everyone))
    survivors = [r for r in everyone if r != quiet]
    live = set(survivors)
    first = emulated_round(buffers, survivors, every, live)  # waits for the quiet rank, then masks it
    assert all(mask_of(buffers[r]) == [int(q == quiet) for q in everyone] for r in survivors)
    masked = emulated_round(buffers, survivors, every, live)
    assert masked < TIMEOUT_S / 2 < first, (first, masked)
    for r in survivors:
        buffers[r].low_latency_clean_mask_buffer()
        assert mask_of(buffers[r]) == [0] * world
    emulated_round(buffers, survivors, every, live)  # missed again, and masked again
    assert all(mask_of(buffers[r]) == [int(q == quiet) for q in everyone] for r in survivors)
    for r in survivors:
        buffers[r].low_latency_update_mask_buffer(quiet, False)
        buffers[r].low_latency_update_mask_buffer(quiet, True)
    assert emulated_round(buffers, survivors, every, live) < TIMEOUT_S / 2
    for b in buffers:
        b.destroy()


def test_without_enable_shrink_the_same_wait_is_a_timeout(seed: int) -> None:
    from ep_layer.emulation import emulated_buffers

    world = 2
    size = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buffers = emulated_buffers(world, size, TIMEOUT_S)
    x, idx, _ = on_gpu(inputs(world, seed))[0]
    buffers[0].low_latency_dispatch(x, idx, T, E, use_fp8=False, return_recv_hook=True)[4]()
    with pytest.raises(EPTimeoutError) as info:
        buffers[0].check()
    assert info.value.ranks == [1]
    with pytest.raises(RuntimeError, match="enable_shrink"):
        mask_of(buffers[0])


def _survive_a_killed_process(rank: int, world: int, seed: int, dead: int, transport: str = "ipc") -> dict[str, float]:
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    every = on_gpu(inputs(world, seed))
    size = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, enable_shrink=True, backend="cuda",
                 timeout_s=TIMEOUT_S, transport=transport)
    num_local = E // world

    def one_round(live: set[int]) -> float:
        x, idx, weights = every[rank]
        start = time.monotonic()
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        y = experts(recv_x, recv_count, rank, num_local)
        out, _, _ = buf.low_latency_combine(y, idx, weights, handle)
        torch.cuda.synchronize()
        took = time.monotonic() - start
        buf.check()
        every_cpu = [tuple(t.cpu() for t in r) for r in every]
        check_dispatch(rank, world, every_cpu, live, recv_x.cpu(), recv_count.cpu())
        assert torch.equal(out.cpu(), expected_combine(*every_cpu[rank], world, live)), rank
        return took

    everyone = set(range(world))
    took = {"before": one_round(everyone)}
    dist.barrier()
    if rank == dead:
        os._exit(0)  # killed between two rounds: its buffer's mappings stay, its kernels never come
    live = everyone - {dead}
    took["first after"] = one_round(live)
    assert mask_of(buf) == [int(r == dead) for r in range(world)]
    took["masked"] = one_round(live)
    buf.destroy()  # with a rank masked, no barrier with the dead rank
    return took


def survivors_mask_a_killed_process(seed: int, rank_fn=_survive_a_killed_process, *args: object) -> None:
    """Four processes, rank 1 killed between two rounds; `rank_fn(rank, world, seed, dead, *args)` runs a rank."""
    from dist_harness import run_ranks

    world, dead = 4, 1
    took = run_ranks(rank_fn, world, seed, dead, *args, timeout_s=120, dies=(dead,))
    for rank, t in enumerate(took):
        if rank != dead:
            assert t["first after"] <= TIMEOUT_S + 5.0 and t["masked"] < TIMEOUT_S / 2, (rank, t)
    print(f"rank {dead} killed: " + ", ".join(f"rank {r}: " + " / ".join(f"{k} {v:.3f} s" for k, v in t.items())
                                              for r, t in enumerate(took) if t))


def test_ipc_survivors_mask_a_killed_process(seed: int) -> None:
    survivors_mask_a_killed_process(seed)
