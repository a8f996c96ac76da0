"""Single-batch overlap's combine (DeepEP forks' `overlap=True`, as SGLang's `--enable-single-batch-overlap`
passes it): the send of each row waits for the expert GEMM's completion signal instead of stream order.

- reference backend (CPU, one rank and two): with every needed signal at its threshold, the Hopper form
  (comp_signal per block_m rows, packed_recv_count) and the Blackwell form (src_signals per expert) give the
  plain combine's output bit for bit; signals of rows past recv_count are not waited for; a needed signal
  below its threshold is a TimeoutError naming the signals within timeout_s; overlap=False ignores them;
  every overlap argument that is wrong is a ValueError naming it;
- cuda backend (GPU): a "GEMM" on another stream writes x late and then its signals; the combine, launched
  before it on a stream that does not wait for it, sends what the GEMM wrote. Without the signals it would
  read x early: the same setup then gives another output, which shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from ep_layer import Buffer, native

T, H, K = 6, 256, 2
BLOCK_M = 4


def setup(rank: int, world: int, buf: Buffer, seed: int) -> dict:
    """One dispatch of random tokens; the expert outputs y (random, in dispatch's layout) and the dispatch's
    results."""
    gen = torch.Generator().manual_seed(seed + rank)
    e = 4 * world
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    _, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, e, use_fp8=False)
    y = torch.randn(e // world, world * T, H, generator=gen).to(torch.bfloat16)
    return {"idx": idx, "weights": weights, "recv_count": recv_count, "handle": handle, "y": y, "experts": e}


def hopper_signals(case: dict, world: int, threshold: int, fill: int | None = None) -> torch.Tensor:
    """comp_signal: ceil(R*T / BLOCK_M) signals per local expert, those of received rows at `threshold` and
    the others (past recv_count) at 0, or all at `fill`."""
    per_expert = -(-world * T // BLOCK_M)
    signals = torch.zeros(case["y"].shape[0] * per_expert, dtype=torch.int32)
    for expert, count in enumerate(case["recv_count"].tolist()):
        blocks = -(-count // BLOCK_M)
        signals[expert * per_expert:expert * per_expert + blocks] = threshold if fill is None else fill
    return signals


def rank_overlap_forms(rank: int, world: int, seed: int) -> None:
    buf = Buffer(torch.distributed.group.WORLD if world > 1 else None, low_latency_mode=True, backend="reference")
    case = setup(rank, world, buf, seed)
    args = (case["y"], case["idx"], case["weights"], case["handle"])
    plain, _, _ = buf.low_latency_combine(*args)
    hopper, _, _ = buf.low_latency_combine(*args, overlap=True, packed_recv_count=case["recv_count"],
                                           comp_signal=hopper_signals(case, world, 3), block_m=BLOCK_M, threshold=3,
                                           num_sms=3)
    assert torch.equal(hopper, plain)
    for dtype in (torch.int32, torch.uint32):
        src_signals = torch.full((case["y"].shape[0],), 5, dtype=torch.int32).to(dtype)
        blackwell, _, hook = buf.low_latency_combine(*args, return_recv_hook=True, overlap=True,
                                                     src_signals=src_signals, src_signal_expect_value=5)
        hook()
        assert torch.equal(blackwell, plain)
    # SGLang without down-GEMM overlap: overlap=False and a cap on the send's SMs.
    capped, _, _ = buf.low_latency_combine(*args, overlap=False, num_sms=3)
    assert torch.equal(capped, plain)


@pytest.mark.parametrize("world", [1, 2])
def test_the_overlap_forms_give_the_plain_combine(world: int, seed: int) -> None:
    run_ranks(rank_overlap_forms, world, seed)


def test_a_signal_below_its_threshold_is_a_timeout_naming_the_signals(seed: int) -> None:
    buf = Buffer(None, low_latency_mode=True, backend="reference", timeout_s=0.3)
    case = setup(0, 1, buf, seed)
    signals = hopper_signals(case, 1, 2)
    needed = int(signals.nonzero()[-1])
    signals[needed] = 1  # one received block never completes
    with pytest.raises(TimeoutError, match=rf"overlap signals \[{needed}\] stayed below the threshold 2"):
        buf.low_latency_combine(case["y"], case["idx"], case["weights"], case["handle"], overlap=True,
                                packed_recv_count=case["recv_count"], comp_signal=signals, block_m=BLOCK_M, threshold=2)
    # The Buffer still works.
    out, _, _ = buf.low_latency_combine(case["y"], case["idx"], case["weights"], case["handle"])
    assert out.shape == (T, H)


def test_every_wrong_overlap_argument_is_named(seed: int) -> None:
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    case = setup(0, 1, buf, seed)
    good = dict(overlap=True, packed_recv_count=case["recv_count"], comp_signal=hopper_signals(case, 1, 1),
                block_m=BLOCK_M, threshold=1)
    blackwell = dict(overlap=True, src_signals=torch.ones(4, dtype=torch.int32), src_signal_expect_value=1)
    bad = [
        ("overlap", dict(good, overlap="yes")),
        ("comp_signal", dict(good, comp_signal=None)),  # neither form
        ("comp_signal", {**good, **blackwell}),  # both
        ("comp_signal", dict(good, comp_signal=torch.ones(2, dtype=torch.int32))),  # fewer than E_l x blocks
        ("comp_signal", dict(good, comp_signal=torch.ones(8, dtype=torch.int64))),
        ("block_m", dict(good, block_m=0)),
        ("block_m", dict(good, block_m=1.5)),
        ("threshold", dict(good, threshold=0)),
        ("packed_recv_count", dict(good, packed_recv_count=case["recv_count"].clone())),  # not the dispatch's
        ("packed_recv_count", dict(good, packed_recv_count=None)),
        ("num_sms", dict(good, num_sms=0)),
        ("num_sms", dict(overlap=False, num_sms=True)),
        ("src_signals", dict(blackwell, src_signals=torch.ones(4, dtype=torch.float32))),
        ("src_signals", dict(blackwell, src_signals=torch.ones(3, dtype=torch.int32))),
        ("src_signal_expect_value", dict(blackwell, src_signal_expect_value=0)),
    ]
    for name, kwargs in bad:
        with pytest.raises(ValueError, match=rf"^{name}: expected"):
            buf.low_latency_combine(case["y"], case["idx"], case["weights"], case["handle"], **kwargs)
    out, _, _ = buf.low_latency_combine(case["y"], case["idx"], case["weights"], case["handle"], **good)
    plain, _, _ = buf.low_latency_combine(case["y"], case["idx"], case["weights"], case["handle"])
    assert torch.equal(out, plain)


# ---------------------------------------------------------------------------- the cuda backend
SLEEP_CYCLES = 50_000_000  # ~25 ms at the H100's and H200's clocks: the combine runs long before it ends


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
@pytest.mark.parametrize("form", ["hopper", "blackwell"])
def test_the_send_waits_for_a_gemm_on_another_stream(form: str, seed: int) -> None:
    torch.cuda.set_device(0)
    dev = torch.device("cuda")
    t, h, e, k = 32, 7168, 16, 8
    gen = torch.Generator(device=dev).manual_seed(seed)
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(t, h, 1, e), low_latency_mode=True,
                 backend="cuda")
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(t, k, device=dev, generator=gen)
    y_true = torch.randn(e, t, h, device=dev, generator=gen).to(torch.bfloat16)
    outputs = {}
    for waits in (True, False):
        _, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        y = torch.zeros_like(y_true)  # what the combine would read before the GEMM wrote it
        signals = torch.zeros(e * (-(-t // 8)) if form == "hopper" else e, dtype=torch.int32, device=dev)
        gemm, comm = torch.cuda.Stream(), torch.cuda.Stream()
        gemm.wait_stream(torch.cuda.current_stream())
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(gemm):  # the GEMM: late, then its rows, then their signals
            torch.cuda._sleep(SLEEP_CYCLES)
            y.copy_(y_true)
            signals.fill_(7)
        with torch.cuda.stream(comm):  # the combine, not waiting for the GEMM's stream
            overlap = {}
            if waits and form == "hopper":
                overlap = dict(overlap=True, packed_recv_count=recv_count, comp_signal=signals, block_m=8, threshold=7,
                               num_sms=3)
            elif waits:
                overlap = dict(overlap=True, src_signals=signals, src_signal_expect_value=7, num_sms=3)
            out, _, hook = buf.low_latency_combine(y, idx, weights, handle, return_recv_hook=True, **overlap)
            hook()
        torch.cuda.synchronize()
        outputs[waits] = out.clone()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    want, _, _ = buf.low_latency_combine(y_true, idx, weights, handle)
    assert torch.equal(outputs[True], want)
    assert not torch.equal(outputs[False], want), "the combine without signals read the rows after the GEMM too"
    buf.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
def test_a_gemm_that_never_signals_is_a_timeout_naming_the_signal(seed: int) -> None:
    dev = torch.device("cuda")
    t, h, e, k = 8, 7168, 16, 8
    gen = torch.Generator(device=dev).manual_seed(seed)
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(t, h, 1, e), low_latency_mode=True,
                 backend="cuda", timeout_s=0.5)
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    _, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    y = torch.randn(e, t, h, device=dev, generator=gen).to(torch.bfloat16)
    signals = torch.zeros(e, dtype=torch.int32, device=dev)  # the GEMM never counts a tile
    _, _, hook = buf.low_latency_combine(y, idx, torch.rand(t, k, device=dev, generator=gen), handle,
                                         return_recv_hook=True, overlap=True, packed_recv_count=recv_count,
                                         comp_signal=signals, block_m=t, threshold=1)
    hook()
    with pytest.raises(TimeoutError, match=r"rank 0: low_latency_combine: the overlap signals \[\d+\] stayed below"):
        buf.check()
