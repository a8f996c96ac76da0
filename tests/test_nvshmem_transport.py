"""The cuda backend over NVSHMEM's symmetric heap (`Buffer(transport="nvshmem")`): the same kernels, each
peer reached at the address NVSHMEM maps its buffer to. On the GPU (with nvshmem4py installed) the IPC
tests' rank functions run unchanged on this transport: low-latency dispatch and combine in every FP8 mode,
with hooks and rows in place, against the reference backend bit for bit, on one process and on several
processes sharing one GPU (NVSHMEM allowed two PEs on one H200 without MPS); normal mode against the
reference; a silent rank named by the timeout; a buffer past NVSHMEM's default heap. On CPU: the
argument errors.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ep_layer import Buffer

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


@pytest.mark.gpu
@pytest.mark.skipif(HAS_NVSHMEM, reason="nvshmem4py is installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda backend needs a GPU before the transport")
def test_without_nvshmem4py_the_error_says_what_to_install() -> None:
    size = Buffer.get_low_latency_rdma_size_hint(8, 512, 1, 4)
    with pytest.raises(RuntimeError, match=r"pip install 'ep-layer\[nvshmem\]'"):
        Buffer(None, 0, size, low_latency_mode=True, backend="cuda", transport="nvshmem")


@needs_nvshmem
@pytest.mark.parametrize("world_size", [1, 2])
def test_low_latency_calls_match_the_reference(world_size: int, seed: int) -> None:
    from dist_harness import run_ranks
    from test_buffer_cuda import _ipc_rank

    run_ranks(_ipc_rank, world_size, seed, 16, "nvshmem", timeout_s=240)


@needs_nvshmem
def test_normal_mode_matches_the_reference(seed: int) -> None:
    from dist_harness import run_ranks
    from test_normal_mode_cuda import _rank_matches_reference

    run_ranks(_rank_matches_reference, 2, seed, "nvshmem", timeout_s=300)


@needs_nvshmem
def test_a_silent_rank_is_named() -> None:
    from dist_harness import run_ranks
    from test_buffer_cuda import _silent_rank

    elapsed = run_ranks(_silent_rank, 2, "nvshmem", timeout_s=120)[0]
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
