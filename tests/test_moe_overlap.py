"""FusedMoE's overlap modes on CPU (the reference backend) and the cost model behind overlap="auto".

The modes' outputs against the plain forward, bit for bit at EP 1, 2 and 4 with an empty batch on one
rank, are in test_moe.py (layer_rank runs every mode); on the GPU in test_moe_triton.py. Here: the
single-batch overlap's plumbing (the combine is told to wait for the down GEMM's signals, and the torch
expert kernels set exactly the signals of the rows they wrote), the argument checks, and the model's
parts against independent computations: a Monte Carlo routing for the active experts, float64 byte
counts for the GEMMs and the exchange.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from moe_helpers import MoeConfig, hf_weights

from ep_layer.moe import FusedMoE, TorchExperts
from ep_layer.moe.overlap import (
    AUTO_MARGIN,
    SBO_OVERHEAD_US,
    GpuRates,
    LayerCost,
    Prediction,
    check_overlap,
    predict,
)
from ep_layer.moe.schedule import COMBINE_HOOKED
from ep_layer.moe.weights import ExpertWeights

H200 = GpuRates(4.2e6, 1.2e9, 0.4e6)


def v3(num_ranks: int, ranks_per_gpu: int) -> LayerCost:
    return LayerCost(7168, 2048, 256, 8, num_ranks, True, 2048, ranks_per_gpu)


@pytest.mark.parametrize(("num_ranks", "tokens"), [(1, 1), (8, 4), (8, 32), (32, 2)])
def test_active_experts_match_random_routing(num_ranks: int, tokens: int, seed: int) -> None:
    """The expected experts of a rank with a row, against routing drawn at random (each token's top_k
    distinct experts, uniformly)."""
    gen = torch.Generator().manual_seed(seed)
    layer = v3(num_ranks, 1)
    per_rank = layer.num_experts // num_ranks
    trials, active = 200, 0.0
    for _ in range(trials):
        picks = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:layer.top_k]
                             for _ in range(tokens * num_ranks)])
        hit = torch.zeros(layer.num_experts, dtype=torch.bool)
        hit[picks.flatten()] = True
        active += hit.view(num_ranks, per_rank).sum(1).float().mean().item()
    expected = layer.active_experts(tokens)
    assert abs(active / trials - expected) <= 0.03 * expected + 0.05, (active / trials, expected)


def test_gemms_read_every_active_experts_weights_once_per_gpu() -> None:
    """Where every expert has rows and the weights outweigh the math, the GEMMs cost a GPU's ranks' expert
    weights (E / R experts x 3 x H x I FP8 bytes each) over HBM, split 2 : 1 between gate_up and down."""
    for ranks_per_gpu in (1, 8):
        layer = v3(8, ranks_per_gpu)
        gate_up, down = layer.gemm_us(128, H200)
        weights = 32 * 3 * 7168 * 2048 * ranks_per_gpu
        assert gate_up + down == pytest.approx(weights / 4.2e6, rel=1e-6)
        assert gate_up == pytest.approx(2 * down, rel=1e-9)


def test_exchange_bytes_and_where_the_combine_moves_them() -> None:
    """Dispatch sends FP8 rows with a float32 scale per 128 values, the combine bf16 rows, (R - 1) / R of
    each token's top_k rows to other ranks; between GPUs the combine's send pushes them, on one GPU its
    receive reads them."""
    tokens = 64
    remote = tokens * 8 * 7 / 8
    across = v3(8, 1).exchange_us(tokens, H200)
    assert across.dispatch == pytest.approx(12 + remote * (7168 + 7168 // 128 * 4) / 0.4e6)
    assert across.combine_send == pytest.approx(6 + remote * 7168 * 2 / 0.4e6) and across.combine_pushed
    assert across.combine_receive == pytest.approx(6)
    shared = v3(8, 8).exchange_us(tokens, H200)
    link = 4.2e6 * 0.65
    assert shared.combine_send == pytest.approx(8 * 6) and not shared.combine_pushed
    assert shared.combine_receive == pytest.approx(8 * 6 + 8 * remote * 7168 * 2 / link)


def test_two_microbatches_never_pay_at_decode_on_one_gpu() -> None:
    """bench_moe's finding (benchmarks/RESULTS.md): at T <= 256 two micro-batches are slower than the plain
    forward at every emulated EP size, since each half reads the active experts' weights again."""
    for ep in (1, 2, 4, 8):
        for tokens in (1, 32, 128, 256):
            p = predict(v3(ep, ep), tokens, H200)
            assert p.dbo > p.none, (ep, tokens, p)


def test_single_batch_overlap_hides_at_most_the_combines_send() -> None:
    for ep, per_gpu in ((2, 1), (8, 1), (8, 8), (32, 1)):
        for tokens in (1, 16, 128, 512):
            layer = v3(ep, per_gpu)
            p = predict(layer, tokens, H200)
            saved = p.none - p.sbo + SBO_OVERHEAD_US
            assert 0 <= saved <= layer.exchange_us(tokens, H200).combine_send + 1e-9, (ep, per_gpu, tokens, p)


def test_best_takes_an_overlap_only_past_the_margin() -> None:
    plain = 1000.0
    just_short = plain * (1 - AUTO_MARGIN) + 1
    assert Prediction(plain, just_short, 2 * plain).best() == "none"
    assert Prediction(plain, just_short - 2, just_short - 10).best() == "dbo"
    assert Prediction(plain, just_short - 2, just_short - 10).best(("sbo",)) == "sbo"
    assert Prediction(plain, 2 * plain, 2 * plain).best() == "none"


def test_the_rates_of_a_cpu_device_are_an_h100s() -> None:
    rates = GpuRates.for_device(torch.device("cpu"))
    assert rates.hbm_bytes_per_us < H200.hbm_bytes_per_us and rates.link_bytes_per_us == H200.link_bytes_per_us


def test_overlap_mode_is_checked_and_auto_runs_plain_on_cpu() -> None:
    cfg = MoeConfig()
    with pytest.raises(ValueError, match="overlap: expected one of"):
        cfg.layer(None, "bf16", overlap="tbo")
    with pytest.raises(ValueError, match="overlap: expected one of"):
        check_overlap(None)
    for mode in ("none", "sbo", "dbo"):
        assert cfg.layer(None, "bf16", overlap=mode).schedule(16, torch.device("cpu")) == mode
    layer = cfg.layer(None, "bf16")
    with pytest.raises(ValueError, match="overlap: expected one of"):
        layer.overlap = "sbo "
    assert layer.overlap == "none"
    assert cfg.layer(None, "bf16", overlap="auto").schedule(16, torch.device("cpu")) == "none"


def _sbo_layer(seed: int) -> tuple[MoeConfig, FusedMoE]:
    """A bf16 layer with overlap="sbo" on the reference backend, random weights."""
    cfg = MoeConfig(max_tokens=16)
    layer = cfg.layer(None, "bf16", overlap="sbo")
    layer.load_weights(hf_weights(cfg, torch.Generator().manual_seed(seed), "bf16").items())
    return cfg, layer


def test_sbo_tells_the_combine_to_wait_for_the_down_gemms_signals(seed: int) -> None:
    """overlap="sbo": one combine with overlap=True, the dispatch's counts and the signals the down GEMM set
    (those of every expert with rows at their threshold); the output is the plain forward's."""
    cfg, layer = _sbo_layer(seed)
    seen: list[dict] = []
    combine = layer.buffer.low_latency_combine

    def spy(*args, **kwargs):
        seen.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        return combine(*args, **kwargs)

    layer.buffer.low_latency_combine = spy
    x = torch.randn(11, cfg.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    got = layer(x)
    (call,) = seen
    assert call["overlap"] is True and call["zero_copy"] is True
    done = (call["packed_recv_count"] > 0).int() * call["threshold"]
    assert torch.equal(call["comp_signal"], done), (call["comp_signal"], call["packed_recv_count"])
    layer.buffer.low_latency_combine = combine
    layer.overlap = "none"
    assert torch.equal(got, layer(x))


def test_sbo_holds_the_signals_until_the_combine_is_waited_for(seed: int) -> None:
    """The send reads the signals on its own stream: freed at the hook's launch, their memory could go to the
    compute stream's next kernels (another rank's, between two steps) while the send still polls it (a GPU
    run hung so). The layer holds them until its last step, which waits for the combine."""
    cfg, layer = _sbo_layer(seed)
    kernels = layer._kernels_for(torch.device("cpu"))
    made = []

    def tracked_signals(*args):
        signals = type(kernels).completion_signals(kernels, *args)
        made.append(weakref.ref(signals.signals))
        return signals

    kernels.completion_signals = tracked_signals
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    steps = layer.steps(x, sbo=True)
    stage = None
    while stage != COMBINE_HOOKED:
        stage = next(steps)
    gc.collect()
    assert made and made[0]() is not None, "the signals were freed before the combine was waited for"
    with pytest.raises(StopIteration):
        next(steps)


def test_sbo_launches_the_down_gemm_before_queuing_the_send_beside_it(seed: int, monkeypatch) -> None:
    """Where the send waits for signals on the device (the cuda backend), it runs on its side stream behind an
    event recorded after the signals are zeroed, on SMs the down GEMM's grid leaves free, and it is queued
    only after the down GEMM's launch: a first
    launch loads the kernel's module, which waits for running kernels, and a send already spinning on the
    GEMM's signals hung a GPU run so. On CPU with stand-ins for the streams: the order of the calls, and the
    plain forward's output."""
    import contextlib

    import ep_layer.moe.layer as layer_module
    from ep_layer import Buffer
    from ep_layer.moe.overlap import SBO_SEND_SMS
    from ep_layer.moe.schedule import run_to_end

    cfg, layer = _sbo_layer(seed)
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    plain = run_to_end(layer.steps(x))
    calls: list[tuple] = []

    @contextlib.contextmanager
    def send_on(stream, after=None):
        calls.append(("send_on", stream, after))
        yield

    def run_hook(hook, stream):
        hook()
        return lambda: None

    kernels = layer._kernels_for(torch.device("cpu"))
    down, combine = kernels.down, layer.buffer.low_latency_combine
    kernels.down = lambda *args, **kwargs: (calls.append(("down", kwargs.get("spare_sms"))), down(*args, **kwargs))[1]
    layer.buffer.low_latency_combine = lambda *a, **k: (calls.append(("combine", k.get("num_sms"))),
                                                        combine(*a, **k))[1]
    monkeypatch.setattr(layer_module, "send_on", send_on)
    monkeypatch.setattr(layer_module, "run_hook", run_hook)
    monkeypatch.setattr(Buffer, "signals_waited_on_device", property(lambda self: True))
    monkeypatch.setattr(layer_module, "current_stream", lambda device_index: "compute stream")
    monkeypatch.setattr(layer_module, "record", {"compute stream": "zeroed"}.__getitem__)
    streams = SimpleNamespace(dispatch="dispatch stream", combine="combine stream")
    got = run_to_end(layer.steps(x, streams, sbo=True))
    # The GEMM's grid leaves the SMs the send may hold.
    assert calls[-3:] == [("down", SBO_SEND_SMS), ("send_on", "combine stream", "zeroed"), ("combine", SBO_SEND_SMS)], \
        calls
    assert torch.equal(got, plain)


def test_torch_experts_signal_each_expert_with_rows_once_written(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weights = ExpertWeights(4, 64, 32, False, "cpu")
    for tensor in weights.buffers():
        tensor.copy_(torch.randn(tensor.shape, generator=gen) / 8)
    counts = torch.tensor([3, 0, 8, 1], dtype=torch.int32)
    x = torch.randn(4, 8, 64, generator=gen).to(torch.bfloat16)
    kernels = TorchExperts()
    signals = kernels.completion_signals(4, 8, 64, torch.device("cpu"))
    got = kernels.down(kernels.gate_up(x, counts, weights), counts, weights, signals=signals)
    assert torch.equal(signals.signals, (counts > 0).int() * signals.threshold)
    want = kernels(x, counts, weights)
    assert got[2].abs().sum() > 0
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(got[e, :n], want[e, :n])
