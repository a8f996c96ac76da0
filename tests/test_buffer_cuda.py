"""The `cuda` backend against independent oracles, on one GPU (skipped without one).

Several ranks share the GPU two ways: emulated in one process (`ep_layer.emulation`: fast, and the
only way to replay all ranks in one CUDA graph), and as real processes that map each other's buffers
through CUDA IPC (the production path). Dispatch is checked exactly (rows, order, bytes, scales,
handle) against a plain-Python routing oracle and the numpy FP8 oracle; combine bit-exactly against
float32 arithmetic in the design's order, and within bf16 rounding against float64.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_graphs import capture_after_warmup

from ep_layer import Buffer, EPTimeoutError, RowsInPlace, native
from ep_layer.emulation import each_rank
from ep_layer.latency import OPS, LatencyHistogram, bucket_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built"),
]

MODES = {  # name: (use_fp8, round_scale, use_ue8m0)
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8-pow2": (True, True, False),
    "fp8-ue8m0": (True, True, True),
}


# ---------------------------------------------------------------------------- inputs and oracles
def make_inputs(rng: np.random.Generator, num_ranks: int, max_tokens: int, hidden: int, num_experts: int,
                topk: int, device: str = "cuda") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random tokens and routing per rank: some ranks may have no tokens, some entries are -1."""
    xs, idxs = [], []
    for _ in range(num_ranks):
        n = int(rng.integers(0, max_tokens + 1))
        x = torch.from_numpy(rng.standard_normal((n, hidden), dtype=np.float32) *
                             rng.choice([1e-3, 1.0, 30.0], size=(n, 1)).astype(np.float32))
        idx = np.array([rng.permutation(num_experts)[:topk] for _ in range(n)], dtype=np.int64).reshape(n, topk)
        idx[rng.random((n, topk)) < 0.1] = -1
        xs.append(x.to(torch.bfloat16).to(device))
        idxs.append(torch.from_numpy(idx.astype(np.int64)).to(device))
    return xs, idxs


def expected_rows(idxs: list[torch.Tensor], num_experts: int) -> dict[int, list[tuple[int, int]]]:
    """Global expert -> its (source rank, token) rows, ordered by source rank then token."""
    rows: dict[int, list[tuple[int, int]]] = {e: [] for e in range(num_experts)}
    for source, idx in enumerate(idxs):
        for token, experts in enumerate(idx.tolist()):
            for e in sorted({e for e in experts if e >= 0}):
                rows[e].append((source, token))
    return rows


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.cpu().view(torch.int16).numpy().view(np.uint16)


def check_dispatch(rank: int, num_ranks: int, max_tokens: int, out: tuple, xs: list[torch.Tensor],
                   rows: dict[int, list[tuple[int, int]]], mode: str, seed: int | str) -> None:
    import fp8_oracle

    recv_x, recv_count, handle = out
    use_fp8, round_scale, use_ue8m0 = MODES[mode]
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    num_local = recv_count.shape[0]
    counts = recv_count.cpu().tolist()
    where = f"seed={seed} rank={rank} mode={mode}"
    for l in range(num_local):
        want = rows[rank * num_local + l]
        assert counts[l] == len(want), f"{where} expert {l}: recv_count"
        assert src_info[l, :len(want)].tolist() == [t for _, t in want], f"{where} expert {l}: src_info/order"
        per_source = [sum(1 for s, _ in want if s == src) for src in range(num_ranks)]
        begins = np.cumsum([0, *per_source[:-1]]).tolist()
        got_ranges = layout_range[l].tolist()
        assert got_ranges == [(b << 32) | c for b, c in zip(begins, per_source)], f"{where}: layout_range"
        if not want:
            continue
        sent = torch.stack([xs[s][t] for s, t in want])
        if not use_fp8:
            assert torch.equal(recv_x[l, :len(want)].cpu(), sent.cpu()), f"{where} expert {l}: bf16 rows"
            continue
        codes, scales = fp8_oracle.cast_to_fp8(bf16_bits(sent), round_scale, use_ue8m0)
        got = recv_x[0][l, :len(want)].cpu().view(torch.uint8).numpy()
        assert np.array_equal(got, codes), f"{where} expert {l}: fp8 bytes"
        got_scales = recv_x[1][l, :len(want)].cpu().numpy()
        assert np.array_equal(got_scales.view(np.uint32), np.asarray(scales).view(np.uint32)), \
            f"{where} expert {l}: scales"
    if use_fp8:
        assert recv_x[1].stride(1) == 1, f"{where}: scales must be column-major"


def packed_from_rows_in_place(recv_x, recv_count: torch.Tensor):
    """Dispatch's packed recv_x from RowsInPlace, each row's data read where its offset says it lies, the
    scales as they are (other recv_x pass through): the oracles above then check the rows in place as
    they check a packed copy."""
    from ep_layer.backends.device_tensor import device_tensor

    if not isinstance(recv_x, RowsInPlace):
        return recv_x
    num_local, rows = recv_x.offsets.shape
    h = recv_x.hidden
    row_bytes = h if recv_x.scales is not None else 2 * h
    packed = torch.zeros(num_local, rows, row_bytes, dtype=torch.uint8, device="cuda")
    start = recv_x.base.data_ptr()
    for l, (count, offsets) in enumerate(zip(recv_count.tolist(), recv_x.offsets.tolist())):
        assert all(o % 128 == 0 for o in offsets[:count]), "rows in place: rows must start on 128-byte lines"
        for m, offset in enumerate(offsets[:count]):
            packed[l, m] = device_tensor(start + offset, (row_bytes,), packed.device, torch.uint8)
    if recv_x.scales is None:
        return packed.view(torch.bfloat16)
    return packed.view(torch.float8_e4m3fn), recv_x.scales


def expected_combine(rank: int, num_local: int, idx: torch.Tensor, weights: torch.Tensor,
                     ys: list[torch.Tensor], rows: dict[int, list[tuple[int, int]]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 in ascending k rounded once to bf16 — the design's exact rule, float64 sum)."""
    n, k_count = idx.shape
    hidden = ys[0].shape[-1]
    exact = torch.zeros(n, hidden, dtype=torch.float32)
    wide = torch.zeros(n, hidden, dtype=torch.float64)
    for t in range(n):
        for k in range(k_count):
            e = int(idx[t, k])
            if e < 0:
                continue
            row = rows[e].index((rank, t))
            y = ys[e // num_local][e % num_local, row].cpu().float()
            exact[t] = exact[t] + weights[t, k].cpu() * y
            wide[t] += weights[t, k].cpu().double() * y.double()
    return exact.to(torch.bfloat16), wide


def check_combine(rank: int, got: torch.Tensor, exact: torch.Tensor, wide: torch.Tensor, where: str) -> None:
    got = got.cpu()
    assert torch.equal(got, exact), f"{where} rank {rank}: combine differs from float32 ascending-k sum"
    tol = 2.0 ** -8 * wide.abs() + 1e-6  # one bf16 rounding of the sum, plus float32 accumulation
    assert bool(((got.double() - wide).abs() <= tol).all()), f"{where} rank {rank}: combine vs float64"


# ---------------------------------------------------------------------------- emulated ranks
def emulated(num_ranks: int, max_tokens: int, hidden: int, num_experts: int, timeout_s: float = 20.0,
             side_by_side: bool = False):
    """`side_by_side`: the ranks will run on RankStreams, so each sizes its grids for its share of the GPU."""
    from ep_layer.emulation import emulated_buffers

    size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts)
    return emulated_buffers(num_ranks, size, timeout_s, gpu_share=num_ranks if side_by_side else 1)


def run_dispatch(buffers, xs, idxs, max_tokens, num_experts, mode, stats=None, streams=None, rows_in_place=False):
    """Every rank's send half first, then every hook: one stream is enough for emulated ranks."""
    use_fp8, round_scale, use_ue8m0 = MODES[mode]
    stats = stats or [None] * len(buffers)
    sent = each_rank([lambda b=b, x=x, i=i, s=s: b.low_latency_dispatch(
        x, i, max_tokens, num_experts, s, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        return_recv_hook=True, rows_in_place=rows_in_place) for b, x, i, s in zip(buffers, xs, idxs, stats)],
        streams)
    each_rank([s[4] for s in sent], streams)
    return [s[:3] for s in sent]


def run_combine(buffers, ys, idxs, weights, handles, streams=None, **kw):
    sent = each_rank([lambda b=b, y=y, i=i, w=w, h=h: b.low_latency_combine(y, i, w, h, return_recv_hook=True, **kw)
                      for b, y, i, w, h in zip(buffers, ys, idxs, weights, handles)], streams)
    each_rank([s[2] for s in sent], streams)
    return [s[0] for s in sent]


def check_round_trip(num_ranks: int, max_tokens: int, hidden: int, num_local: int, topk: int, mode: str,
                     concurrent: bool, seed: int, rows_in_place: bool = False) -> None:
    """Two dispatches (both buffer halves) and a combine of emulated ranks against the oracles; the first
    dispatch's rows are checked again after the second (two results may be outstanding)."""
    from ep_layer.emulation import RankStreams

    rng = np.random.default_rng(seed)
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts, side_by_side=concurrent)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    stats = [torch.zeros(num_local, dtype=torch.int32, device="cuda") for _ in buffers]
    streams = RankStreams(num_ranks) if concurrent else None
    rows = expected_rows(idxs, num_experts)
    rounds = []
    for _ in range(2):  # consecutive calls use the two halves of the buffers
        stats_before = [s.clone() for s in stats]
        outs = run_dispatch(buffers, xs, idxs, max_tokens, num_experts, mode, stats=stats, streams=streams,
                            rows_in_place=rows_in_place)
        torch.cuda.synchronize()
        for b in buffers:
            b.check()
        for r, o in enumerate(outs):
            assert isinstance(o[0], RowsInPlace) == rows_in_place, f"seed={seed}: recv_x {type(o[0]).__name__}"
            check_dispatch(r, num_ranks, max_tokens, (packed_from_rows_in_place(o[0], o[1]), *o[1:]), xs, rows,
                           mode, seed)
            assert torch.equal(stats[r] - stats_before[r], o[1]), f"seed={seed}: recv stats"
        rounds.append(outs)
    for r, o in enumerate(rounds[0]):
        check_dispatch(r, num_ranks, max_tokens, (packed_from_rows_in_place(o[0], o[1]), *o[1:]), xs, rows, mode,
                       f"{seed} (first dispatch, after the second)")

    ys = [torch.randn(num_local, num_ranks * max_tokens, hidden, device="cuda").to(torch.bfloat16)
          for _ in buffers]
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]
    combined = run_combine(buffers, ys, idxs, weights, [o[2] for o in outs], streams=streams)
    torch.cuda.synchronize()
    for r in range(num_ranks):
        exact, wide = expected_combine(r, num_local, idxs[r].cpu(), weights[r], ys, rows)
        check_combine(r, combined[r], exact, wide, f"seed={seed} mode={mode}")
    for b in buffers:
        b.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("concurrent", [False, True], ids=["one-stream", "rank-streams"])
def test_emulated_dispatch_combine(num_ranks: int, mode: str, concurrent: bool, seed: int) -> None:
    """Emulated ranks against the oracles; with rank-streams each rank's kernels of a phase run on a
    stream of their own, concurrently."""
    rng = np.random.default_rng(seed)
    max_tokens = int(rng.integers(1, 40))
    hidden = int(rng.choice([512, 1024, 2048, 7168]))
    num_local = int(rng.integers(1, 9))
    topk = int(rng.integers(1, min(9, num_ranks * num_local) + 1))
    check_round_trip(num_ranks, max_tokens, hidden, num_local, topk, mode, concurrent, seed)


@pytest.mark.parametrize("num_ranks", [1, 2, 8])
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-pow2"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["one-stream", "rank-streams"])
def test_emulated_rows_in_place(num_ranks: int, mode: str, concurrent: bool, seed: int) -> None:
    """rows_in_place=True: the rows its offsets name, read where they lie (peers' slots for ranks on one
    GPU, rank 0's own slots for its own tokens), are exactly the rows a packed dispatch gives; the
    handle and stats are the same, and the combine after it works."""
    rng = np.random.default_rng(seed)
    max_tokens = int(rng.integers(1, 40))
    hidden = int(rng.choice([512, 7168]))
    num_local = int(rng.integers(1, 9))
    topk = int(rng.integers(1, min(9, num_ranks * num_local) + 1))
    check_round_trip(num_ranks, max_tokens, hidden, num_local, topk, mode, concurrent, seed, rows_in_place=True)


def test_rows_in_place_with_ue8m0_is_refused() -> None:
    (buffer,) = emulated(1, 8, 512, 4)
    x = torch.zeros(2, 512, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
    assert buffer.supports_rows_in_place
    with pytest.raises(ValueError, match="rows_in_place"):
        buffer.low_latency_dispatch(x, idx, 8, 4, use_fp8=True, round_scale=True, use_ue8m0=True, rows_in_place=True)
    buffer.destroy()


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_emulated_send_blocks_with_many_tokens(mode: str, seed: int) -> None:
    """Eight ranks on one GPU get a send block per 1/8 of the GPU's resident blocks, so at these T each
    block sends several tokens, over more than one pass of eight (partial passes included)."""
    rng = np.random.default_rng(seed)
    max_tokens = int(rng.integers(150, 400))
    hidden = int(rng.choice([512, 7168]))
    check_round_trip(8, max_tokens, hidden, 32, 8, mode, True, seed)


@pytest.mark.parametrize("hidden", [512, 7168, 16384])
def test_a_profiler_sees_one_dispatch_and_one_combine_kernel(hidden: int, seed: int) -> None:
    """As DeepEP's kernels, whichever way they are called: a plain call is one launch of its op's kernel,
    a hooked call two launches (send, then the hook's receive) of that same kernel. DeepEP's own test
    (tests/utils.py bench_kineto) wants exactly one profiler row naming each op, and `::dispatch` /
    `::combine` in the traced names."""
    rng = np.random.default_rng(seed)
    max_tokens, num_experts, topk = 64, 32, 8
    (buffer,) = emulated(1, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, 1, max_tokens, hidden, num_experts, topk)
    weights = torch.rand(xs[0].shape[0], topk, device="cuda")
    calls = 3

    def pair(hook: bool) -> None:
        recv_x, _, handle, _, recv_hook = buffer.low_latency_dispatch(xs[0], idxs[0], max_tokens, num_experts,
                                                                      use_fp8=True, return_recv_hook=hook)
        if hook:
            recv_hook()
        y = torch.ones(recv_x[0].shape, dtype=torch.bfloat16, device="cuda")
        _, _, combine_hook = buffer.low_latency_combine(y, idxs[0], weights, handle, return_recv_hook=hook)
        if hook:
            combine_hook()

    for hook in (False, True):
        pair(hook)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                pair(hook)
            torch.cuda.synchronize()
        kernels = {e.key: e.count for e in prof.key_averages() if e.device_time_total > 0}
        for op in ("dispatch", "combine"):
            named = {name: count for name, count in kernels.items() if op in name}
            assert len(named) == 1, (hook, named)
            (name, count), = named.items()
            assert f"::{op}" in name and count == calls * (2 if hook else 1), (hook, name, count)


@pytest.mark.parametrize("max_tokens,hidden,num_experts,topk",
                         [(1, 512, 4, 2), (37, 7168, 288, 8), (1024, 128, 1024, 16), (8, 16384, 16, 16)])
def test_dispatch_without_hook_runs_one_kernel(max_tokens: int, hidden: int, num_experts: int, topk: int,
                                               seed: int) -> None:
    """Without a hook, dispatch runs both halves as one kernel whose grid is capped at the blocks the GPU
    holds at once (T = 1024: several tokens per block). Plain calls alternate with hooked ones on one
    buffer (sequence numbers and buffer halves carry on across both), in every mode, then a CUDA graph
    of a plain call replays with fresh tokens."""
    rng = np.random.default_rng(seed)
    (buffer,) = emulated(1, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, 1, max_tokens, hidden, num_experts, topk)
    rows = expected_rows(idxs, num_experts)
    for mode, (use_fp8, round_scale, use_ue8m0) in MODES.items():
        if use_ue8m0 and hidden % 512:
            continue
        for hook, in_place in ((False, False), (True, False), (False, not use_ue8m0), (True, not use_ue8m0)):
            out = buffer.low_latency_dispatch(xs[0], idxs[0], max_tokens, num_experts, use_fp8=use_fp8,
                                              round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook,
                                              rows_in_place=in_place)
            if hook:
                out[4]()
            buffer.check()
            check_dispatch(0, 1, max_tokens, (packed_from_rows_in_place(out[0], out[1]), *out[1:3]), xs, rows, mode,
                           f"{seed} hook={hook} in_place={in_place}")

    def call():
        return buffer.low_latency_dispatch(xs[0], idxs[0], max_tokens, num_experts, use_fp8=False)

    graph, out = capture_after_warmup(call)
    for replay in range(5):
        xs[0].copy_(torch.randn_like(xs[0], dtype=torch.float32))
        graph.replay()
        buffer.check()
        check_dispatch(0, 1, max_tokens, out[:3], xs, rows, "bf16", f"{seed} replay {replay}")
    buffer.destroy()


@pytest.mark.parametrize("arrangement", ["neighbours", "shuffled"])
def test_fp8_cast_of_every_bf16_value(arrangement: str, seed: int) -> None:
    """Every finite bf16 bit pattern (-0 included, arranged as fp8_oracle.every_finite_bf16 says) through
    dispatch's FP8 cast, which divides by the scale without a division instruction, against the numpy
    oracle, in every FP8 mode and both kernels (one kernel without a hook, send + hook with it)."""
    import fp8_oracle

    tokens, hidden, num_experts = 16, 4096, 4
    bits = fp8_oracle.every_finite_bf16(arrangement, tokens * hidden, seed)
    x = torch.from_numpy(bits.view(np.int16).reshape(tokens, hidden)).view(torch.bfloat16).cuda()
    idx = (torch.arange(tokens) % num_experts).view(tokens, 1).cuda()
    rows = expected_rows([idx], num_experts)
    (buffer,) = emulated(1, tokens, hidden, num_experts)
    for mode in ("fp8", "fp8-pow2", "fp8-ue8m0"):
        _, round_scale, use_ue8m0 = MODES[mode]
        for hook in (False, True):
            out = buffer.low_latency_dispatch(x, idx, tokens, num_experts, use_fp8=True, round_scale=round_scale,
                                              use_ue8m0=use_ue8m0, return_recv_hook=hook)
            if hook:
                out[4]()
            buffer.check()
            check_dispatch(0, 1, tokens, out[:3], [x], rows, mode, f"{seed} {arrangement} hook={hook}")
    buffer.destroy()


def hooked_dispatch_of_two_ranks(seed: int):
    """Two emulated ranks (T = 16, H = 1024, 8 experts, top-4) that have sent a bf16 dispatch with a hook:
    (buffers, routing, handles, hooks, recv_x shape); the results themselves are dropped."""
    rng = np.random.default_rng(seed)
    max_tokens, hidden, num_experts = 16, 1024, 8
    buffers = emulated(2, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, 2, max_tokens, hidden, num_experts, 4)
    sent = [b.low_latency_dispatch(x, i, max_tokens, num_experts, use_fp8=False, return_recv_hook=True)
            for b, x, i in zip(buffers, xs, idxs)]
    return buffers, idxs, [s[2] for s in sent], [s[4] for s in sent], sent[0][0].shape


def test_hooks_keep_the_outputs_a_caller_dropped(seed: int) -> None:
    """A caller may drop dispatch's recv_x or combine's output before running the hook (a benchmark that
    only moves data does). The hook's kernel still writes them, so their memory must not go to the next
    tensors of the stream first: here tensors of the same sizes, allocated right after, take the freed
    blocks if the backend let them go (found by a bench_moe --smoke crash: misaligned addresses)."""
    buffers, idxs, handles, hooks, shape = hooked_dispatch_of_two_ranks(seed)
    sentinels = [torch.full(shape, 7.0, dtype=torch.bfloat16, device="cuda") for _ in buffers]
    for hook in hooks:
        hook()
    ys = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in buffers]
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]
    hooks = [b.low_latency_combine(y, i, w, h, return_recv_hook=True)[2]
             for b, y, i, w, h in zip(buffers, ys, idxs, weights, handles)]
    out_sentinels = [torch.full((i.shape[0], shape[2]), 7.0, dtype=torch.bfloat16, device="cuda") for i in idxs]
    for hook in hooks:
        hook()
    torch.cuda.synchronize()
    for b in buffers:
        b.check()
    for r in range(2):
        assert bool((sentinels[r] == 7).all()), f"seed={seed} rank {r}: the dispatch hook wrote a freed recv_x"
        assert bool((out_sentinels[r] == 7).all()), f"seed={seed} rank {r}: the combine hook wrote a freed output"
    for b in buffers:
        b.destroy()


def test_a_hook_on_another_stream_keeps_the_dropped_outputs(seed: int) -> None:
    """The hooks run on a second stream that is held back by a long kernel, while the send stream goes on
    and allocates tensors of the dropped outputs' sizes: the outputs must be kept until the hooks' kernels
    have run there (recorded on that stream), not only until they were launched."""
    buffers, _, _, hooks, shape = hooked_dispatch_of_two_ranks(seed)
    hook_stream = torch.cuda.Stream()
    hook_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(hook_stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the hooks' kernels run well after the sentinels are written
        for hook in hooks:
            hook()
    sentinels = [torch.full(shape, 7.0, dtype=torch.bfloat16, device="cuda") for _ in buffers]
    torch.cuda.synchronize()
    for b in buffers:
        b.check()
    for r in range(2):
        assert bool((sentinels[r] == 7).all()), f"seed={seed} rank {r}: the hook's kernel wrote a reused recv_x"
    for b in buffers:
        b.destroy()


def test_emulated_options(seed: int) -> None:
    """out=, zero_copy, async_finish and the wait stats on the cuda backend."""
    rng = np.random.default_rng(seed)
    num_ranks, max_tokens, hidden, num_local, topk = 4, 16, 1024, 3, 4
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    waits = [torch.zeros(num_ranks, dtype=torch.int64, device="cuda") for _ in buffers]
    outs = run_dispatch(buffers, xs, idxs, max_tokens, num_experts, "bf16")
    rows = expected_rows(idxs, num_experts)
    ys = [torch.randn(num_local, num_ranks * max_tokens, hidden, device="cuda").to(torch.bfloat16)
          for _ in buffers]
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]
    for b, o, y in zip(buffers, outs, ys):
        zero_copy = b.get_next_low_latency_combine_buffer(o[2])
        # In the communication buffer, where the ranks sharing this GPU read the rows (none are copied).
        assert b._live()._row_in_buffer(zero_copy.data_ptr(), o[2]) >= 0
        zero_copy.copy_(y)
    outs_buf = [torch.full((i.shape[0], hidden), float("nan"), device="cuda", dtype=torch.bfloat16) for i in idxs]
    sent = [b.low_latency_combine(torch.empty_like(y), i, w, o[2], zero_copy=True, out=ob,
                                  return_recv_hook=True, combine_wait_recv_cost_stats=ws)
            for b, y, i, w, o, ob, ws in zip(buffers, ys, idxs, weights, outs, outs_buf, waits)]
    for s, ob in zip(sent, outs_buf):
        assert s[0] is ob
        s[2]()
    for r in range(num_ranks):
        exact, wide = expected_combine(r, num_local, idxs[r].cpu(), weights[r], ys, rows)
        check_combine(r, outs_buf[r], exact, wide, f"seed={seed} zero_copy")
        assert bool((waits[r] >= 0).all())
    for b in buffers:
        b.destroy()


def test_graph_replay(seed: int) -> None:
    """Two graphs (different routing widths) over the same buffers, replayed 100 times in random order."""
    rng = np.random.default_rng(seed)
    num_ranks, max_tokens, hidden, num_local = 4, 24, 2048, 4
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts)
    graphs = []
    scale = torch.arange(1, num_experts + 1, device="cuda", dtype=torch.float32)  # read by both graphs
    for topk, mode in ((4, "fp8"), (8, "bf16")):
        xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
        weights = [torch.rand(i.shape, device="cuda") for i in idxs]

        def step(xs=xs, idxs=idxs, weights=weights, mode=mode):
            outs = run_dispatch(buffers, xs, idxs, max_tokens, num_experts, mode)
            ys = []
            for r, (recv_x, _, _) in enumerate(outs):  # "expert" e returns (e + 1) * its input
                data = recv_x if mode == "bf16" else recv_x[0].float()
                if mode != "bf16":
                    s = recv_x[1].repeat_interleave(128, dim=2)
                    data = data * s
                ys.append((data.float() * scale[r * num_local:(r + 1) * num_local, None, None]).to(torch.bfloat16))
            return run_combine(buffers, ys, idxs, weights, [o[2] for o in outs])

        graph, out = capture_after_warmup(step)
        graphs.append((graph, xs, idxs, weights, out, mode))
    for replay in range(100):
        graph, xs, idxs, weights, out, mode = graphs[int(rng.integers(0, 2))]
        for x, w in zip(xs, weights):  # fresh inputs each replay, routing kept
            x.copy_(torch.randn_like(x, dtype=torch.float32))
            w.copy_(torch.rand_like(w))
        graph.replay()
        for b in buffers:
            b.check()
        for r in range(num_ranks):
            idx = idxs[r].double()
            factor = (weights[r].double() * torch.where(idx >= 0, idx + 1, 0)).sum(1, keepdim=True)
            want = xs[r].double() * factor
            tol = 0.07 * want.abs() + 0.07 * factor.abs() * xs[r].double().abs().amax(1, keepdim=True) / 16 + 1e-3
            got = out[r].double()
            assert bool(((got - want).abs() <= tol).all()), \
                f"seed={seed} replay {replay} rank {r} mode {mode}: max err {(got - want).abs().max()}"
    for b in buffers:
        b.destroy()


def test_dispatch_wait_stats_time_a_late_rank_that_sends_no_token(seed: int) -> None:
    """The receive waits only for the slots a source filled, so a source with no tokens gives it no slot
    to wait for: its lateness must still reach dispatch_wait_recv_cost_stats (the wait for its counts)."""
    rng = np.random.default_rng(seed)
    max_tokens, hidden, num_experts, topk = 8, 1024, 4, 2
    buffers = emulated(2, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, 1, max_tokens, hidden, num_experts, topk)
    xs.append(torch.empty(0, hidden, dtype=torch.bfloat16, device="cuda"))
    idxs.append(torch.empty(0, topk, dtype=torch.int64, device="cuda"))
    run_dispatch(buffers, xs, idxs, max_tokens, num_experts, "fp8")  # loads the kernels: a lazy load would wait
    waits = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in buffers]  # for the sleep below to end
    late = torch.cuda.Stream()
    sent = [buffers[0].low_latency_dispatch(xs[0], idxs[0], max_tokens, num_experts,
                                            dispatch_wait_recv_cost_stats=waits[0], return_recv_hook=True)]
    late.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(late):
        torch.cuda._sleep(GAP_CYCLES)  # rank 1 sends ~2 ms after rank 0's receive starts waiting for it
        sent.append(buffers[1].low_latency_dispatch(xs[1], idxs[1], max_tokens, num_experts,
                                                    dispatch_wait_recv_cost_stats=waits[1], return_recv_hook=True))
    sent[0][4]()
    with torch.cuda.stream(late):
        sent[1][4]()
    torch.cuda.synchronize()
    for b in buffers:
        b.check()
    rows = expected_rows(idxs, num_experts)
    for r in range(2):
        check_dispatch(r, 2, max_tokens, sent[r][:3], xs, rows, "fp8", f"{seed} late rank")
    assert waits[0][1].item() > 500_000, f"rank 0 waited {waits[0].tolist()} ns for ranks 0, 1"
    for b in buffers:
        b.destroy()


def test_emulated_timeout_names_missing_rank() -> None:
    buffers = emulated(2, 8, 512, 4, timeout_s=1.0)
    x = torch.randn(8, 512, device="cuda").to(torch.bfloat16)
    idx = torch.tensor([[0, 3]] * 8, device="cuda")
    start = time.monotonic()
    *_, hook = buffers[0].low_latency_dispatch(x, idx, 8, 4, return_recv_hook=True)
    hook()  # rank 1 never sends
    with pytest.raises(EPTimeoutError) as info:
        buffers[0].check()
    assert info.value.ranks == [1]
    assert time.monotonic() - start < 10
    stats = buffers[0].latency_stats()["dispatch"]  # the failed call counts, with the time it waited
    assert stats.count == 1 and stats.counts[-1] == 1 and stats.sum_s >= 1.0, stats


def test_emulated_disagreeing_ranks_raise_on_every_rank() -> None:
    buffers = emulated(2, 8, 1024, 4, timeout_s=5.0)
    sent = []
    for rank, hidden in enumerate((512, 1024)):
        x = torch.randn(4, hidden, device="cuda").to(torch.bfloat16)
        idx = torch.tensor([[0, 3]] * 4, device="cuda")
        sent.append(buffers[rank].low_latency_dispatch(x, idx, 8, 4, return_recv_hook=True))
    for s in sent:
        s[4]()
    for b in buffers:
        with pytest.raises(ValueError, match="different"):
            b.check()


def test_bad_expert_id_raises() -> None:
    (buffer,) = emulated(1, 8, 512, 4, timeout_s=5.0)
    x = torch.randn(2, 512, device="cuda").to(torch.bfloat16)
    buffer.low_latency_dispatch(x, torch.tensor([[0, 4], [1, -1]], device="cuda"), 8, 4)
    with pytest.raises(ValueError, match="topk_idx"):
        buffer.check()


# ---------------------------------------------------------------------------- latency stats
GAP_CYCLES = 4_000_000  # torch.cuda._sleep between a send and its hook: ~2 ms at H200 clocks
SPAN_SLACK_S = 2e-6  # per call: globaltimer ticks (as coarse as 1 us) at both ends of its two spans


def latency_totals(buffers) -> tuple[dict[str, list[int]], float]:
    """(per op: each rank's call count, total seconds over all ranks and both ops)."""
    stats = [b.latency_stats() for b in buffers]
    counts = {op: [s[op].count for s in stats] for op in OPS}
    return counts, sum(s[op].sum_s for s in stats for op in OPS)


def timed_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def test_latency_stats_count_every_call_and_leave_out_the_hook_gap(seed: int) -> None:
    """Emulated ranks on one stream: two micro-batches in flight per op (send A, send B, hook A, hook B),
    ~2 ms of other work between the sends and the hooks, a rank without tokens. Every call counts
    once; all calls' latencies add up to no more than the stream's time minus the gaps (the kernels
    of all ranks run one after another on it), and no call reaches the gap's buckets."""
    rng = np.random.default_rng(seed)
    num_ranks, max_tokens, hidden, num_local, topk, rounds = 2, 16, 1024, 2, 3, 4
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    xs[1], idxs[1] = xs[1][:0], idxs[1][:0]  # rank 1 has no tokens: its combine receive counts all the same
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]
    assert latency_totals(buffers) == ({op: [0, 0] for op in OPS}, 0.0)
    start, end = timed_events()
    gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def other_work() -> None:
        gaps.append(timed_events())
        gaps[-1][0].record()
        torch.cuda._sleep(GAP_CYCLES)
        gaps[-1][1].record()

    start.record()
    for _ in range(rounds):
        sent = [[b.low_latency_dispatch(x, i, max_tokens, num_experts, use_fp8=False, return_recv_hook=True)
                 for b, x, i in zip(buffers, xs, idxs)] for _ in range(2)]
        other_work()
        for micro_batch in sent:
            for *_, hook in micro_batch:
                hook()
        combined = [[b.low_latency_combine(o[0], i, w, o[2], return_recv_hook=True)
                     for b, o, i, w in zip(buffers, micro_batch, idxs, weights)] for micro_batch in sent]
        other_work()
        for micro_batch in combined:
            for *_, hook in micro_batch:
                hook()
    end.record()
    torch.cuda.synchronize()
    for b in buffers:
        b.check()
    counts, total_s = latency_totals(buffers)
    calls = 2 * rounds
    assert counts == {op: [calls] * num_ranks for op in OPS}, f"seed={seed}: {counts}"
    stream_s = (start.elapsed_time(end) - sum(a.elapsed_time(b) for a, b in gaps)) / 1e3
    slack_s = SPAN_SLACK_S * 2 * calls * num_ranks
    assert 0 < total_s <= stream_s + slack_s, (f"seed={seed}: latencies add up to {total_s * 1e3:.3f} ms, the "
                                               f"stream without the gaps ran {stream_s * 1e3:.3f} ms")
    assert total_s / (2 * calls * num_ranks) > 1e-6, f"seed={seed}: {total_s} s for all calls is implausibly short"
    gap_bucket = bucket_of(int(min(a.elapsed_time(b) for a, b in gaps) * 1e6) // 2)
    for r, b in enumerate(buffers):
        for op, hist in b.latency_stats().items():
            assert sum(hist.counts[gap_bucket:]) == 0, f"seed={seed} rank {r} {op}: a call took as long as a gap"
    for b in buffers:
        b.destroy()


def test_latency_stats_plain_and_async_calls(seed: int) -> None:
    """One emulated rank: plain calls (both halves at once) and async_finish (on a side stream) count too."""
    rng = np.random.default_rng(seed)
    max_tokens, hidden, num_experts, topk = 8, 512, 4, 2
    (buffer,) = emulated(1, max_tokens, hidden, num_experts)
    (x,), (idx,) = make_inputs(rng, 1, max_tokens, hidden, num_experts, topk)
    w = torch.rand(idx.shape, device="cuda")
    start, end = timed_events()
    start.record()
    for async_finish in (False, False, True, False, True):
        recv_x, _, handle, event, _ = buffer.low_latency_dispatch(x, idx, max_tokens, num_experts, use_fp8=False,
                                                                  async_finish=async_finish)
        if event is not None:
            event.current_stream_wait()
        _, event, _ = buffer.low_latency_combine(recv_x, idx, w, handle, async_finish=async_finish)
        if event is not None:
            event.current_stream_wait()
    end.record()
    torch.cuda.synchronize()
    buffer.check()
    counts, total_s = latency_totals([buffer])
    assert counts == {op: [5] for op in OPS}, f"seed={seed}: {counts}"
    assert 0 < total_s <= start.elapsed_time(end) / 1e3 + SPAN_SLACK_S * 10, f"seed={seed}: {total_s} s"
    buffer.destroy()


def test_latency_stats_count_graph_replays(seed: int) -> None:
    """A captured dispatch + combine on 2 emulated ranks: capturing runs nothing and counts nothing,
    each replay counts once per rank and op, inside the replays' stream time."""
    rng = np.random.default_rng(seed)
    num_ranks, max_tokens, hidden, num_local, topk, replays = 2, 16, 2048, 2, 4, 10
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]

    def step() -> list[torch.Tensor]:
        outs = run_dispatch(buffers, xs, idxs, max_tokens, num_experts, "bf16")
        return run_combine(buffers, [o[0] for o in outs], idxs, weights, [o[2] for o in outs])

    graph, _ = capture_after_warmup(step)  # the warm-up makes one call per rank and op
    counts, before_s = latency_totals(buffers)
    assert counts == {op: [1] * num_ranks for op in OPS}, f"seed={seed}: warm-up and capture counted {counts}"
    start, end = timed_events()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    for b in buffers:
        b.check()
    counts, after_s = latency_totals(buffers)
    assert counts == {op: [1 + replays] * num_ranks for op in OPS}, f"seed={seed}: {counts}"
    slack_s = SPAN_SLACK_S * 2 * replays * num_ranks
    assert 0 < after_s - before_s <= start.elapsed_time(end) / 1e3 + slack_s, \
        f"seed={seed}: replays' latencies {after_s - before_s} s, replays ran {start.elapsed_time(end) / 1e3} s"
    for b in buffers:
        b.destroy()


def test_latency_stats_deferred_accounting_counts_each_call_once(seed: int) -> None:
    """The kernels account a call late: the send kernel that reuses its buffer half (two calls later)
    adds it to the device histogram, and latency_stats() adds the calls still waiting without touching
    the device. Two micro-batches in flight per op (send A, send B, hook A, hook B) on 2 emulated ranks,
    read repeatedly: between rounds, twice in a row, between a send and its hook, across
    clean_low_latency_buffer. Every completed call counts exactly once, a read changes nothing, and the
    sums grow only by what ran in between."""
    rng = np.random.default_rng(seed)
    num_ranks, max_tokens, hidden, num_local, topk = 2, 8, 512, 2, 2
    num_experts = num_ranks * num_local
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    weights = [torch.rand(i.shape, device="cuda") for i in idxs]

    def send_dispatch() -> list:
        return [b.low_latency_dispatch(x, i, max_tokens, num_experts, use_fp8=False, return_recv_hook=True)
                for b, x, i in zip(buffers, xs, idxs)]

    def combine(micro_batches: list) -> None:
        sent = [[b.low_latency_combine(o[0], i, w, o[2], return_recv_hook=True)
                 for b, o, i, w in zip(buffers, micro_batch, idxs, weights)] for micro_batch in micro_batches]
        for micro_batch in sent:
            for *_, hook in micro_batch:
                hook()

    def rounds(n: int) -> None:
        for _ in range(n):
            sent = [send_dispatch(), send_dispatch()]
            for micro_batch in sent:
                for *_, hook in micro_batch:
                    hook()
            combine(sent)

    def read(calls: dict[str, int], where: str) -> list[dict]:
        torch.cuda.synchronize()
        for b in buffers:
            b.check()
        stats = [b.latency_stats() for b in buffers]
        counts = {op: [s[op].count for s in stats] for op in OPS}
        assert counts == {op: [calls[op]] * num_ranks for op in OPS}, f"seed={seed} {where}: {counts}"
        return stats

    def total_s(stats: list[dict]) -> float:
        return sum(s[op].sum_s for s in stats for op in OPS)

    assert read({"dispatch": 0, "combine": 0}, "fresh") == [{op: LatencyHistogram.empty() for op in OPS}] * num_ranks
    rounds(3)
    first = read({"dispatch": 6, "combine": 6}, "3 rounds")
    assert read({"dispatch": 6, "combine": 6}, "read again") == first, f"seed={seed}: a read changed the stats"

    start, end = timed_events()
    start.record()
    rounds(2)
    end.record()
    second = read({"dispatch": 10, "combine": 10}, "5 rounds")
    grown_s = total_s(second) - total_s(first)
    slack_s = SPAN_SLACK_S * 2 * 2 * 2 * 2 * num_ranks  # per call: 2 rounds x 2 micro-batches x 2 ops
    assert 0 < grown_s <= start.elapsed_time(end) / 1e3 + slack_s, \
        f"seed={seed}: the stats grew by {grown_s} s, the 2 rounds ran {start.elapsed_time(end) / 1e3} s"

    # A send alone moves the call two before it from the waiting records into the device histogram:
    # the stats do not change. Its own call counts once its hook has run.
    pending = send_dispatch()
    assert read({"dispatch": 10, "combine": 10}, "send without hook") == second, f"seed={seed}"
    for *_, hook in pending:
        hook()
    read({"dispatch": 11, "combine": 10}, "after the hook")
    combine([pending])
    before_clean = read({"dispatch": 11, "combine": 11}, "before clean")

    for b in buffers:  # clears the timing records: their calls must stay counted
        b.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    assert read({"dispatch": 11, "combine": 11}, "after clean") == before_clean, f"seed={seed}"
    rounds(1)
    read({"dispatch": 13, "combine": 13}, "a round after clean")
    for b in buffers:
        b.destroy()


# ---------------------------------------------------------------------------- real processes (IPC)
def _ipc_rank(rank: int, world_size: int, seed: int, max_tokens: int, transport: str = "ipc",
              check: Callable[[Buffer, int], None] | None = None) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())  # several GPUs: peers over NVLink
    rng = np.random.default_rng(seed)  # same stream on every rank: shared shapes, per-rank inputs below
    hidden, num_local, topk = 1024, 3 if world_size > 1 else 4, 4  # one rank: its experts hold the top-4
    num_experts = world_size * num_local
    size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world_size, num_experts)
    cuda = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=60, transport=transport)
    ref = Buffer(dist.group.WORLD, low_latency_mode=True, backend="reference", timeout_s=60)
    if check is not None:  # what the caller asserts about the Buffer made (its transport's settings)
        check(cuda, world_size)
    xs, idxs = make_inputs(rng, world_size, max_tokens, hidden, num_experts, topk, device="cpu")
    x, idx = xs[rank], idxs[rank]
    for mode, (use_fp8, round_scale, use_ue8m0) in MODES.items():
        kw = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        want = ref.low_latency_dispatch(x, idx, max_tokens, num_experts, **kw)
        for hook_mode, in_place in ((False, False), (True, False), (True, not use_ue8m0)):
            got = cuda.low_latency_dispatch(x.cuda(), idx.cuda(), max_tokens, num_experts,
                                            return_recv_hook=hook_mode, rows_in_place=in_place, **kw)
            if hook_mode:
                got[4]()
            cuda.check()
            got = (packed_from_rows_in_place(got[0], got[1]), *got[1:])
            counts = want[1].tolist()
            assert got[1].cpu().tolist() == counts, f"seed={seed} {mode}"
            for l, c in enumerate(counts):
                assert torch.equal(got[2][0][l, :c].cpu(), want[2][0][l, :c]), f"seed={seed} {mode} src_info"
                if use_fp8:
                    assert torch.equal(got[0][0][l, :c].cpu().view(torch.uint8), want[0][0][l, :c].view(torch.uint8))
                    assert torch.equal(got[0][1][l, :c].cpu(), want[0][1][l, :c]), f"seed={seed} {mode} scales"
                else:
                    assert torch.equal(got[0][l, :c].cpu(), want[0][l, :c]), f"seed={seed} {mode} rows"
            assert torch.equal(got[2][1].cpu(), want[2][1]), f"seed={seed} {mode} layout_range"
        y = torch.randn(num_local, world_size * max_tokens, hidden).to(torch.bfloat16)
        w = torch.rand(idx.shape)
        want_out = ref.low_latency_combine(y, idx, w, want[2])[0]
        got_out, event, _ = cuda.low_latency_combine(y.cuda(), idx.cuda(), w.cuda(), got[2],
                                                     async_finish=True)
        event.current_stream_wait()
        cuda.check()
        assert torch.equal(got_out.cpu(), want_out), f"seed={seed} {mode} rank {rank}: combine vs reference"
    stats = cuda.latency_stats()  # every call of every mode counted once, on this rank's own histograms
    assert (stats["dispatch"].count, stats["combine"].count) == (3 * len(MODES), len(MODES)), f"seed={seed}"
    assert all(0 < stats[op].sum_s < 60 for op in OPS), f"seed={seed}: {stats}"
    cuda.destroy()


def _empty_microbatch_rank(rank: int, world_size: int, seed: int, transport: str = "ipc") -> None:
    """Two micro-batches per step (send A, send B, hook A, combine A, hook B, combine B, hooks), B empty
    on every rank, the last rank slow before its hook B. The others leave their (empty) combine B
    early and send the next step's B into a buffer half the slow rank has not read yet, unless the
    empty combine still waits for its peers."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    rng = np.random.default_rng(seed)
    max_tokens, hidden, num_local, topk = 8, 512, 2, 2
    num_experts = world_size * num_local
    size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world_size, num_experts)
    buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=10, transport=transport)
    xs, idxs = make_inputs(rng, world_size, max_tokens, hidden, num_experts, topk, device="cuda")
    x_a, idx_a = xs[rank], idxs[rank]
    w_a = torch.rand(idx_a.shape, device="cuda")
    x_b, idx_b = x_a[:0], idx_a[:0]
    outs = []
    for _ in range(20):
        recv_a, _, handle_a, _, hook_a = buf.low_latency_dispatch(x_a, idx_a, max_tokens, num_experts,
                                                                   use_fp8=False, return_recv_hook=True)
        recv_b, _, handle_b, _, hook_b = buf.low_latency_dispatch(x_b, idx_b, max_tokens, num_experts,
                                                                   use_fp8=False, return_recv_hook=True)
        hook_a()
        out_a, _, comb_hook_a = buf.low_latency_combine(recv_a, idx_a, w_a, handle_a, return_recv_hook=True)
        if rank == world_size - 1:
            torch.cuda._sleep(20_000_000)  # ~10 ms: the peers run ahead meanwhile
        hook_b()
        _, _, comb_hook_b = buf.low_latency_combine(recv_b, idx_b, w_a[:0], handle_b, return_recv_hook=True)
        comb_hook_a()
        comb_hook_b()
        outs.append(out_a.clone())
    buf.check()  # an overwritten half shows up as a receive that never sees its sequence number
    assert all(torch.equal(o, outs[0]) for o in outs), f"seed={seed} rank {rank}: step outputs differ"
    buf.destroy()


def test_ipc_empty_microbatch_keeps_ranks_in_step(seed: int) -> None:
    from dist_harness import run_ranks

    run_ranks(_empty_microbatch_rank, 2, seed, timeout_s=120)


@pytest.mark.parametrize("world_size,max_tokens", [(2, 16), (4, 16), (8, 16), (2, 400)])
def test_ipc_ranks_match_reference(world_size: int, max_tokens: int, seed: int) -> None:
    """Processes on one GPU (pulled payloads) or on several (pushed); at T = 400 each send block has two
    tokens or more (264 blocks fit on an H200 at once, shared by the ranks on a GPU)."""
    from dist_harness import run_ranks

    run_ranks(_ipc_rank, world_size, seed, max_tokens, timeout_s=240)


def _silent_rank(rank: int, world_size: int, transport: str = "ipc") -> float:
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    size = Buffer.get_low_latency_rdma_size_hint(8, 512, world_size, 4)
    buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=2.0, transport=transport)
    if rank == 1:
        return 0.0  # never calls dispatch
    start = time.monotonic()
    x = torch.randn(8, 512, device="cuda").to(torch.bfloat16)
    buf.low_latency_dispatch(x, torch.tensor([[0, 3]] * 8, device="cuda"), 8, 4)
    with pytest.raises(EPTimeoutError) as info:
        buf.check()
    assert info.value.ranks == [1]
    return time.monotonic() - start


def test_ipc_timeout_names_missing_rank() -> None:
    from dist_harness import run_ranks

    elapsed = run_ranks(_silent_rank, 2, timeout_s=120)[0]
    assert 1.5 < elapsed < 20


@pytest.mark.parametrize("max_tokens,hidden,num_experts,topk", [(1024, 128, 1024, 16), (8, 16384, 16, 16)])
def test_emulated_shape_limits(max_tokens: int, hidden: int, num_experts: int, topk: int, seed: int) -> None:
    """The largest supported T, E, K and H (8 ranks of one node), checked like any other shape; the ranks
    side by side, so that at T = 1024 each send block has 32 tokens (four passes)."""
    from ep_layer.emulation import RankStreams

    rng = np.random.default_rng(seed)
    num_ranks = 8
    buffers = emulated(num_ranks, max_tokens, hidden, num_experts, side_by_side=True)
    xs, idxs = make_inputs(rng, num_ranks, max_tokens, hidden, num_experts, topk)
    outs = run_dispatch(buffers, xs, idxs, max_tokens, num_experts, "fp8", streams=RankStreams(num_ranks))
    for b in buffers:
        b.check()
    rows = expected_rows(idxs, num_experts)
    for r, o in enumerate(outs):
        check_dispatch(r, num_ranks, max_tokens, o, xs, rows, "fp8", seed)
    for b in buffers:
        b.destroy()


def test_cuda_backend_rejects_shapes_beyond_its_limits() -> None:
    (buffer,) = emulated(1, 8, 16384 + 128, 4)
    x = torch.randn(2, 16384 + 128, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected a hidden size"):
        buffer.low_latency_dispatch(x, torch.zeros(2, 1, dtype=torch.int64, device="cuda"), 8, 4)
    (buffer,) = emulated(1, 8, 256, 2048)
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="num_experts"):
        buffer.low_latency_dispatch(x, torch.zeros(2, 1, dtype=torch.int64, device="cuda"), 8, 2048)
    with pytest.raises(ValueError, match="at most 8 ranks"):
        emulated(9, 8, 256, 9)
