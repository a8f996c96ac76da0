"""The cuda backend over NVSHMEM's symmetric heap (`Buffer(transport="nvshmem")`): the kernels' NVSHMEM
build (ep_layer._C_nvshmem), each peer reached at the address NVSHMEM maps its buffer to, or by NVSHMEM puts
(every peer with EP_LAYER_NVSHMEM_FORCE_PUTS=1, as a peer on another node would be). On the GPU (with
nvshmem4py installed) the IPC tests' rank functions run unchanged on this transport, both ways: low-latency
dispatch and combine in every FP8 mode, with hooks and rows in place, against the reference backend bit
for bit, on one process and on two processes sharing one GPU (NVSHMEM allowed two PEs on one H200 without
MPS); CUDA-graph replays of dispatch and combine (zero-copy and staged) against the reference; a silent rank
named by the timeout; two micro-batches with an empty one; rank masking of a killed process (four PEs).
Also normal mode against the reference both ways (with forced puts every peer is read with NVSHMEM gets,
also past one scan window and one landing piece), a rank that never calls normal mode named both ways, and a
buffer past NVSHMEM's default heap. On CPU: the argument errors, the install hint and how `auto` decides.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from ep_layer import Buffer, native
from ep_layer.backends import nvshmem_heap

HAS_NVSHMEM = importlib.util.find_spec("nvshmem") is not None


def needs_nvshmem(test):
    """A GPU test of this transport: skipped without a GPU or without nvshmem4py."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
                 pytest.mark.skipif(not HAS_NVSHMEM, reason="needs nvshmem4py (pip install 'ep-layer[nvshmem]')")):
        test = mark(test)
    return test


def test_transport_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"^transport: expected one of \('auto', 'ipc', 'nvshmem'\), got 'rdma'"):
        Buffer(None, low_latency_mode=True, backend="reference", transport="rdma")
    with pytest.raises(ValueError, match=r"^transport: 'nvshmem' is a transport of the cuda backend"):
        Buffer(None, low_latency_mode=True, backend="reference", transport="nvshmem")


@pytest.mark.skipif(HAS_NVSHMEM, reason="nvshmem4py is installed")
def test_without_nvshmem4py_the_error_says_what_to_install() -> None:
    assert not native.nvshmem_available()
    with pytest.raises(ImportError, match=r"pip install 'ep-layer\[nvshmem\]'"):
        native.load_nvshmem()


def test_forced_puts_reach_every_rank_and_unmapped_peers_always(monkeypatch: pytest.MonkeyPatch) -> None:
    mapped = nvshmem_heap.SymmetricBuffer(None, [0x1000, None, 0x3000])
    monkeypatch.delenv(nvshmem_heap.FORCE_PUTS, raising=False)
    assert nvshmem_heap.put_ranks(mapped) == 0b010
    monkeypatch.setenv(nvshmem_heap.FORCE_PUTS, "1")
    assert nvshmem_heap.put_ranks(mapped) == 0b111
    monkeypatch.setenv(nvshmem_heap.FORCE_PUTS, "yes")
    with pytest.raises(ValueError, match=r"^EP_LAYER_NVSHMEM_FORCE_PUTS: expected 0 or 1, got yes"):
        nvshmem_heap.put_ranks(mapped)


@pytest.fixture(params=[False, True], ids=["load-store", "forced-puts"])
def forced_puts(request: pytest.FixtureRequest) -> bool:
    """Both ways of reaching the peers, passed to the ranks (their processes come from a fork server, whose
    environment is the one it started with)."""
    return request.param


def _force_puts(forced: bool) -> None:
    """A rank's setting, before it makes its Buffer."""
    import os

    os.environ[nvshmem_heap.FORCE_PUTS] = "1" if forced else "0"


def _check_put_ranks(buffer: Buffer, world_size: int, forced: bool) -> None:
    """The setting reached the kernels' arguments: otherwise a forced-put test would pass on loads and stores."""
    assert buffer._live()._put_ranks == ((1 << world_size) - 1 if forced else 0)


def _low_latency_rank(rank: int, world_size: int, seed: int, forced: bool) -> None:
    from functools import partial

    from test_buffer_cuda import _ipc_rank

    _force_puts(forced)
    _ipc_rank(rank, world_size, seed, 16, "nvshmem", check=partial(_check_put_ranks, forced=forced))


@needs_nvshmem
@pytest.mark.parametrize("world_size", [1, 2])
def test_low_latency_calls_match_the_reference(world_size: int, seed: int, forced_puts: bool) -> None:
    from dist_harness import run_ranks

    run_ranks(_low_latency_rank, world_size, seed, forced_puts, timeout_s=240)


def _graph_inputs(rng: np.random.Generator, max_tokens: int, hidden: int, num_experts: int,
                  topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full batch (a graph's shapes are fixed): bf16 rows, distinct experts per token with some -1, weights."""
    x = torch.from_numpy(rng.standard_normal((max_tokens, hidden), dtype=np.float32)).to(torch.bfloat16)
    idx = np.array([rng.permutation(num_experts)[:topk] for _ in range(max_tokens)], dtype=np.int64)
    idx[rng.random(idx.shape) < 0.1] = -1
    return x, torch.from_numpy(idx), torch.from_numpy(rng.random(idx.shape, dtype=np.float32))


def _graph_rank(rank: int, world_size: int, seed: int, forced: bool) -> None:
    """Dispatch, then combine (zero-copy: rows put from where they lie; staged: copied to the stage area
    first), captured once and replayed on fresh inputs, each replay against the reference backend."""
    import torch.distributed as dist
    from cuda_graphs import capture_after_warmup

    _force_puts(forced)
    torch.cuda.set_device(0)
    rng = np.random.default_rng([seed, rank])
    max_tokens, hidden, num_local, topk = 8, 512, 3, 3
    num_experts = world_size * num_local
    size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world_size, num_experts)
    cuda = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=60, transport="nvshmem")
    ref = Buffer(dist.group.WORLD, low_latency_mode=True, backend="reference", timeout_s=60)
    _check_put_ranks(cuda, world_size, forced)
    x = torch.zeros(max_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(max_tokens, topk, dtype=torch.int64, device="cuda")
    w = torch.zeros(max_tokens, topk, device="cuda")
    y = torch.zeros(num_local, world_size * max_tokens, hidden, dtype=torch.bfloat16, device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        recv, count, handle, _, _ = cuda.low_latency_dispatch(x, idx, max_tokens, num_experts, use_fp8=False)
        zero_copy = cuda.get_next_low_latency_combine_buffer(handle)
        zero_copy.copy_(recv * 2)
        in_place = cuda.low_latency_combine(zero_copy, idx, w, handle, zero_copy=True)[0]
        # After the zero-copy combine: with put ranks a staged combine stages its rows in that buffer.
        staged = cuda.low_latency_combine(y, idx, w, handle)[0]
        return recv, count, staged, in_place

    for replay in range(4):
        x_cpu, idx_cpu, w_cpu = _graph_inputs(rng, max_tokens, hidden, num_experts, topk)
        y_cpu = torch.from_numpy(rng.standard_normal(tuple(y.shape), dtype=np.float32)).to(torch.bfloat16)
        x.copy_(x_cpu), idx.copy_(idx_cpu), w.copy_(w_cpu), y.copy_(y_cpu)
        if replay == 0:
            graph, (recv, count, staged, in_place) = capture_after_warmup(step)
        graph.replay()
        torch.cuda.synchronize()
        cuda.check()
        want_recv, want_count, want_handle, _, _ = ref.low_latency_dispatch(x_cpu, idx_cpu, max_tokens, num_experts,
                                                                            use_fp8=False)
        assert count.cpu().tolist() == want_count.tolist(), f"seed={seed} replay {replay}"
        rows = torch.zeros_like(want_recv)
        for l, c in enumerate(want_count.tolist()):
            assert torch.equal(recv[l, :c].cpu(), want_recv[l, :c]), f"seed={seed} replay {replay} rows"
            rows[l, :c] = want_recv[l, :c] * 2
        want_staged = ref.low_latency_combine(y_cpu, idx_cpu, w_cpu, want_handle)[0]
        want_in_place = ref.low_latency_combine(rows, idx_cpu, w_cpu, want_handle)[0]
        assert torch.equal(staged.cpu(), want_staged), f"seed={seed} replay {replay}: staged combine"
        assert torch.equal(in_place.cpu(), want_in_place), f"seed={seed} replay {replay}: zero-copy combine"
    cuda.destroy()


@needs_nvshmem
@pytest.mark.parametrize("world_size", [1, 2])
def test_graph_replays_match_the_reference(world_size: int, seed: int, forced_puts: bool) -> None:
    from dist_harness import run_ranks

    run_ranks(_graph_rank, world_size, seed, forced_puts, timeout_s=240)


def _check_get_ranks(buffer: Buffer, world_size: int, forced: bool) -> None:
    """Normal mode reads every peer with NVSHMEM gets exactly when puts are forced."""
    assert buffer._live()._normal._get_ranks == ((1 << world_size) - 1 if forced else 0)


def _normal_rank(rank: int, world_size: int, seed: int, forced: bool) -> None:
    from functools import partial

    from test_normal_mode_cuda import _rank_matches_reference

    _force_puts(forced)
    _rank_matches_reference(rank, world_size, seed, "nvshmem", check=partial(_check_get_ranks, world_size=world_size,
                                                                             forced=forced))


@needs_nvshmem
@pytest.mark.parametrize("world_size", [1, 2])
def test_normal_mode_matches_the_reference(world_size: int, seed: int, forced_puts: bool) -> None:
    from dist_harness import run_ranks

    run_ranks(_normal_rank, world_size, seed, forced_puts, timeout_s=300)


def _normal_windows_rank(rank: int, world_size: int, seed: int) -> None:
    import torch.distributed as dist
    from test_normal_mode_cuda import _buffers, _round

    _force_puts(True)
    torch.cuda.set_device(0)
    cuda, ref = _buffers(dist.group.WORLD, transport="nvshmem")
    _check_get_ranks(cuda, world_size, True)
    rng = np.random.default_rng([seed, rank])
    # Past the scan's window of is_token_in_rank (32 KiB of R-byte rows) from rank 0, then rows longer than a
    # warp's landing piece (the gather fetches them in two pieces, the reduce in nine).
    window = 32768 // world_size
    for tokens, hidden, fp8 in ((window + 600 if rank == 0 else 7, 128, None), (40, 17408, None),
                                (40, 17408, "ue8m0")):
        _round(cuda, ref, rng, world_size, rank, hidden, 4 * world_size, 3, fp8,
               f"seed={seed} T={tokens} H={hidden} fp8={fp8}", tokens=tokens)
    cuda.destroy()
    ref.destroy()


@needs_nvshmem
def test_normal_mode_gets_past_one_window_and_one_piece(seed: int) -> None:
    """Forced gets where the scan needs several windows and a row several pieces."""
    from dist_harness import run_ranks

    run_ranks(_normal_windows_rank, 2, seed, timeout_s=300)


def _empty_microbatch_rank_with(rank: int, world_size: int, seed: int, forced: bool) -> None:
    from test_buffer_cuda import _empty_microbatch_rank

    _force_puts(forced)
    _empty_microbatch_rank(rank, world_size, seed, "nvshmem")


@needs_nvshmem
def test_an_empty_microbatch_keeps_ranks_in_step(seed: int, forced_puts: bool) -> None:
    from dist_harness import run_ranks

    run_ranks(_empty_microbatch_rank_with, 2, seed, forced_puts, timeout_s=120)


def _killed_process_rank(rank: int, world_size: int, seed: int, dead: int, forced: bool) -> dict[str, float]:
    from test_rank_masking_cuda import _survive_a_killed_process

    _force_puts(forced)
    return _survive_a_killed_process(rank, world_size, seed, dead, "nvshmem")


@needs_nvshmem
def test_survivors_mask_a_killed_process(seed: int, forced_puts: bool) -> None:
    """Rank masking: four PEs on one GPU, one killed between two rounds."""
    from test_rank_masking_cuda import survivors_mask_a_killed_process

    survivors_mask_a_killed_process(seed, _killed_process_rank, forced_puts)


def _normal_silent_rank_with(rank: int, world_size: int, forced: bool) -> float:
    from test_normal_mode_cuda import _rank_silent

    _force_puts(forced)
    return _rank_silent(rank, world_size, "nvshmem")


@needs_nvshmem
def test_a_rank_that_never_calls_normal_mode_is_named(forced_puts: bool) -> None:
    from dist_harness import run_ranks

    elapsed = run_ranks(_normal_silent_rank_with, 2, forced_puts, timeout_s=120)[0]
    assert 2 <= elapsed < 10, elapsed


def _silent_rank_with(rank: int, world_size: int, forced: bool) -> float:
    from test_buffer_cuda import _silent_rank

    _force_puts(forced)
    return _silent_rank(rank, world_size, "nvshmem")


@needs_nvshmem
def test_a_silent_rank_is_named(forced_puts: bool) -> None:
    from dist_harness import run_ranks

    elapsed = run_ranks(_silent_rank_with, 2, forced_puts, timeout_s=120)[0]
    assert 1.5 < elapsed < 20



def _large_buffer_rank(rank: int, world: int) -> int:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=3 << 30, low_latency_mode=False, backend="cuda", transport="nvshmem")
    idx = torch.tensor([[0], [1]], device="cuda")
    layout = buf.get_dispatch_layout(idx, 2)
    x = torch.randn(2, 128, device="cuda").to(torch.bfloat16)
    recv = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                        topk_idx=idx)
    out = buf.combine(recv[0], recv[4])[0]
    buf.check()
    assert torch.equal(out, x)
    buf.destroy()
    return 0


@needs_nvshmem
def test_a_buffer_larger_than_nvshmem_default_heap() -> None:
    """NVSHMEM's heap is 1 GiB unless told otherwise; the first Buffer sizes it (3 GiB here)."""
    from dist_harness import run_ranks

    run_ranks(_large_buffer_rank, 1, timeout_s=120)


def _spans_hosts_rank(rank: int, world_size: int, same_host: bool) -> bool:
    import socket

    import torch.distributed as dist

    from ep_layer import backends

    socket.gethostname = lambda: "node" if same_host else f"node{rank}"  # this rank's process only
    return backends._spans_hosts(dist.group.WORLD, world_size)


@pytest.mark.parametrize("same_host", [True, False])
def test_auto_transport_asks_whether_the_ranks_span_hosts(same_host: bool) -> None:
    """`auto` picks NVSHMEM across hosts: the question is answered from every rank's host name."""
    from dist_harness import run_ranks

    assert run_ranks(_spans_hosts_rank, 3, same_host, timeout_s=60) == [not same_host] * 3


@pytest.mark.parametrize(("one_node", "nvshmem", "num_ranks", "want"), [
    (True, False, 8, "cuda"), (True, False, 9, "reference"), (False, False, 2, "reference"),
    (False, True, 8, "cuda"), (False, True, 16, "reference")])
def test_auto_backend_across_nodes_needs_nvshmem_and_at_most_eight_ranks(
        monkeypatch: pytest.MonkeyPatch, one_node: bool, nvshmem: bool, num_ranks: int, want: str) -> None:
    from ep_layer.backends import resolve_backend

    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "nvshmem_available", lambda: nvshmem)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto", one_node=one_node, num_ranks=num_ranks) == want
