"""`ep_layer.moe` on CPU against independent oracles.

- routing: transformers' DeepseekV3TopkRouter (the same logits in, the same experts and weights out),
  with random non-zero correction biases, negative ones included (dropped groups must be -inf, not 0);
- the whole layer at EP = 1, 2 and 4 (gloo ranks, reference Buffer backend): transformers'
  DeepseekV3MoE with the same HF-named weights, in float32 (tight) and in bf16 (looser);
- FP8 block weights: a float64 computation on the dequantised weights, within FP8 error;
- two micro-batches == plain forward, bit for bit; expert kernels on ragged rows; load_weights errors.

Tolerances (|ours - ref| <= tol * (|ref| + rms(ref)) per element, rms over the rank's output):
- vs float32 HF: 2**-5. Our path rounds to bf16 a handful of times (SiLU*up, each expert's output,
  the combined sum, the shared expert, the final add), 2**-9 relative each, of terms that can exceed
  the result; we measured up to 0.012.
- vs bf16 HF: 2**-4. HF also rounds each linear's output and accumulates experts in bf16 (0.023 seen).
- FP8 vs float64: e4m3 keeps 3 mantissa bits (unit roundoff 2**-4); activations are cast twice
  (dispatch and before the down GEMM), errors average over the dot products: we bound the relative
  RMS error of a rank's output by 2**-4 (0.043 seen) and each token's relative error by 2**-3 (0.08 seen).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from dist_harness import run_ranks
from moe_helpers import (
    OVERLAPS,
    MoeConfig,
    dense_weights,
    dequant_loop,
    hf_weights,
    layer_rank,
    mlp_float64,
    moe_float64,
    random_tokens,
)

from ep_layer import Buffer, RowsInPlace
from ep_layer.block_fp8 import block_cast_to_fp8, block_dequant
from ep_layer.moe import (
    ExpertWeights,
    FusedMoE,
    RoutingConfig,
    TorchExperts,
    make_expert_kernels,
    noaux_tc_route,
    route,
    run_two_microbatches,
)
from ep_layer.moe.experts import check_rows_in_place
from ep_layer.moe.layer import forward_two_microbatches
from ep_layer.moe.loading import scale_slot, weight_slot
from ep_layer.moe.schedule import (
    COMBINE_HOOKED,
    COMBINE_SENT,
    DISPATCH_HOOKED,
    DISPATCH_SENT,
    ROUTED,
    SHARED_QUEUED,
    Steps,
    run_to_end,
)
from ep_layer.moe.tiles import ROW_TILE
from ep_layer.quant import per_token_cast_to_fp8

TOL_HF_FP32 = 2.0 ** -5
TOL_HF_BF16 = 2.0 ** -4
TOL_FP8_RMS = 2.0 ** -4
TOL_FP8_TOKEN = 2.0 ** -3

ROUTING_CONFIGS = {  # name: (E, K, n_group, topk_group, bias range)
    "v3-like": (32, 8, 8, 4, (-0.3, 0.3)),
    "groups-of-2": (16, 3, 8, 3, (-0.5, 0.5)),
    "negative-bias": (16, 4, 4, 2, (-2.0, -1.0)),
    "one-group": (12, 2, 1, 1, (-0.2, 0.2)),
    "keep-all-groups": (16, 4, 4, 4, (-0.2, 0.2)),
}


# ---------------------------------------------------------------------------- transformers oracles
def hf_config(cfg: MoeConfig):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=cfg.hidden, moe_intermediate_size=cfg.intermediate,
                            n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, n_group=cfg.n_group,
                            topk_group=cfg.topk_group, n_shared_experts=cfg.n_shared_experts,
                            routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True, hidden_act="silu")


def hf_moe(cfg: MoeConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    """transformers' DeepseekV3MoE holding `weights` (HF checkpoint names; per-expert gate and up are
    stacked into gate_up_proj exactly as transformers' own checkpoint conversion does)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    experts = range(cfg.num_experts)
    state = {
        "gate.weight": weights["gate.weight"].float(),
        "gate.e_score_correction_bias": weights["gate.e_score_correction_bias"],
        "experts.gate_up_proj": torch.stack([torch.cat([weights[f"experts.{e}.gate_proj.weight"],
                                                        weights[f"experts.{e}.up_proj.weight"]]) for e in experts]),
        "experts.down_proj": torch.stack([weights[f"experts.{e}.down_proj.weight"] for e in experts]),
    }
    for p in ("gate", "up", "down"):
        state[f"shared_experts.{p}_proj.weight"] = weights[f"shared_experts.{p}_proj.weight"]
    module = DeepseekV3MoE(hf_config(cfg))
    module.load_state_dict({k: v.float() for k, v in state.items()})
    module = module.to(dtype)
    # .to() would round the correction bias too; checkpoints keep it in float32, and so does FusedMoE.
    module.gate.e_score_correction_bias.data = weights["gate.e_score_correction_bias"].clone()
    return module.eval()


def hf_router(num_experts: int, top_k: int, n_group: int, topk_group: int, hidden: int,
              gen: torch.Generator, bias_range: tuple[float, float]) -> torch.nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = MoeConfig(num_experts=num_experts, top_k=top_k, hidden=hidden, n_group=n_group, topk_group=topk_group)
    router = DeepseekV3TopkRouter(hf_config(cfg))
    low, high = bias_range
    router.weight.data = torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5
    router.e_score_correction_bias.data = low + (high - low) * torch.rand(num_experts, generator=gen)
    return router


def ranks_results(results: list[dict[str, np.ndarray]]) -> list[dict[str, torch.Tensor]]:
    """layer_rank's numpy results back as tensors (outputs as float32 holding bf16 values exactly)."""
    return [{k: torch.from_numpy(v) for k, v in r.items()} for r in results]


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.double(), want.double()
    if want.numel() == 0:
        assert got.shape == want.shape, what
        return
    scale = want.abs() + want.pow(2).mean().sqrt()
    worst = ((got - want).abs() / scale).max().item()
    assert worst <= tol, f"{what}: max |err| / (|ref| + rms) = {worst:.4f} > {tol}"


# ---------------------------------------------------------------------------- routing
@pytest.mark.parametrize("name", list(ROUTING_CONFIGS))
def test_routing_matches_transformers(name: str, seed: int) -> None:
    num_experts, top_k, n_group, topk_group, bias_range = ROUTING_CONFIGS[name]
    gen = torch.Generator().manual_seed(seed)
    hidden, tokens = 64, 300
    router = hf_router(num_experts, top_k, n_group, topk_group, hidden, gen, bias_range)
    config = RoutingConfig(num_experts, top_k, n_group, topk_group, 2.5)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        logits, hf_weights_, hf_idx = router(x)
    bias = router.e_score_correction_bias
    idx, weights = noaux_tc_route(logits, bias, config)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32 and idx.shape == (tokens, top_k)
    # The same experts per token; HF's topk is unsorted, so compare in expert order.
    order, hf_order = idx.argsort(1), hf_idx.argsort(1)
    assert torch.equal(idx.gather(1, order), hf_idx.gather(1, hf_order)), f"seed={seed}: experts differ"
    # Same weights up to the order HF sums the top-k scores in (a few float32 ulps).
    torch.testing.assert_close(weights.gather(1, order), hf_weights_.gather(1, hf_order), rtol=1e-6, atol=0,
                               msg=lambda m: f"seed={seed}: {m}")
    # The bias must matter here (it steers selection), else this test would not check it.
    plain_idx, _ = noaux_tc_route(logits, torch.zeros_like(bias), config)
    assert not torch.equal(plain_idx.sort(1).values, idx.sort(1).values), f"seed={seed}: bias changed nothing"
    # From hidden states (FusedMoE's entry point), with its own float32 logits.
    idx2, weights2 = route(x, router.weight.data, bias, config)
    assert torch.equal(idx2.sort(1).values, idx.sort(1).values), f"seed={seed}"
    torch.testing.assert_close(weights2, weights, rtol=1e-5, atol=0)


def test_routing_drops_groups_even_with_negative_scores() -> None:
    """All biased scores negative: experts of dropped groups must not be picked (masked to -inf, not 0)."""
    config = RoutingConfig(num_experts=8, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    logits = torch.tensor([[4.0, 3.0, -4, -4, 2.0, 1.5, -4, -4]])
    idx, weights = noaux_tc_route(logits, torch.full((8,), -5.0), config)
    assert sorted(idx[0].tolist()) == [0, 1, 4]
    s = torch.sigmoid(logits[0, [0, 1, 4]])
    torch.testing.assert_close(weights[0].sort().values, (s / s.sum()).sort().values)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"n_group": 3}, "n_group"), ({"topk_group": 5}, "topk_group"), ({"top_k": 9}, "top_k"),
    ({"n_group": 8, "topk_group": 2}, "at least 2 experts")])
def test_routing_config_errors(kwargs: dict, match: str) -> None:
    args = {"num_experts": 8, "top_k": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**args)


# ---------------------------------------------------------------------------- the whole layer
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_matches_transformers(world: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    cfg = MoeConfig()
    weights = hf_weights(cfg, gen, "bf16")
    tokens = random_tokens(cfg, gen, world)
    results = ranks_results(run_ranks(layer_rank, world, cfg, "bf16", weights, tokens, False))
    hf32, hf16 = hf_moe(cfg, weights, torch.float32), hf_moe(cfg, weights, torch.bfloat16)
    for rank, (x, got) in enumerate(zip(tokens, results)):
        what = f"seed={seed} EP={world} rank {rank} ({x.shape[0]} tokens)"
        assert got["plain"].shape == x.shape, what
        with torch.no_grad():
            assert_close(got["plain"], hf32(x.float()), TOL_HF_FP32, what + " vs float32 HF")
            assert_close(got["plain"], hf16(x), TOL_HF_BF16, what + " vs bf16 HF")
        assert torch.equal(got["plain"], got["overlapped"]), what + ": two micro-batches differ"
        assert_overlaps_equal_plain(got, what)
    # Every routed (token, expert) pair arrived once at its expert, and was counted there (once per forward:
    # the plain one, the two-micro-batch one and one under each overlap mode each dispatch every token).
    load = torch.cat([r["expert_load"] for r in results])
    routed = torch.cat([r["topk_idx"] for r in results]).flatten()
    forwards = 2 + len(OVERLAPS)
    assert torch.equal(load, forwards * torch.bincount(routed, minlength=cfg.num_experts).int()), f"seed={seed}"


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_layer_matches_float64(world: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # intermediate 192: the 128x128 scale blocks of gate/up/down end in a partial block
    cfg = MoeConfig(intermediate=192, max_tokens=32)
    weights = hf_weights(cfg, gen, "fp8")
    tokens = random_tokens(cfg, gen, world, min_tokens=8)
    results = ranks_results(run_ranks(layer_rank, world, cfg, "fp8-block", weights, tokens, True))
    for rank, (x, got) in enumerate(zip(tokens, results)):
        what = f"seed={seed} EP={world} rank {rank}"
        want = torch.from_numpy(moe_float64(cfg, weights, x, got["topk_idx"], got["topk_weights"]))
        err = got["plain"].double() - want
        rel_rms = (err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
        assert rel_rms <= TOL_FP8_RMS, f"{what}: relative RMS error {rel_rms:.4f}"
        per_token = (err.norm(dim=1) / want.norm(dim=1)).max().item()
        assert per_token <= TOL_FP8_TOKEN, f"{what}: worst token's relative error {per_token:.4f}"
        assert torch.equal(got["plain"], got["overlapped"]), what + ": two micro-batches differ"
        assert_overlaps_equal_plain(got, what)


def assert_overlaps_equal_plain(got: dict[str, torch.Tensor], what: str) -> None:
    for mode in OVERLAPS:
        assert torch.equal(got["plain"], got[f"overlap={mode}"]), f"{what}: overlap={mode!r} differs"


@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
def test_two_microbatches_equal_plain_at_ep4(quant: str, seed: int) -> None:
    """Bit for bit, with every rank's batch size different (odd, 1 and 0 included); the same for every overlap
    mode of FusedMoE."""
    gen = torch.Generator().manual_seed(seed)
    cfg = MoeConfig(intermediate=128, max_tokens=40)
    weights = hf_weights(cfg, gen, "bf16" if quant == "bf16" else "fp8")
    counts = [0, 1, int(torch.randint(2, 40, (1,), generator=gen)) | 1, 40]
    tokens = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16) for n in counts]
    for rank, got in enumerate(ranks_results(run_ranks(layer_rank, 4, cfg, quant, weights, tokens, True))):
        what = f"seed={seed} rank {rank} ({counts[rank]} tokens)"
        assert torch.equal(got["plain"], got["overlapped"]), what
        assert_overlaps_equal_plain(got, what)


def test_two_microbatches_interleave_communication() -> None:
    """The order of sends, hooks and compute follows the overlapped schedule."""
    cfg = MoeConfig(max_tokens=8)
    layer = cfg.layer(None, "bf16")
    layer.load_weights(hf_weights(cfg, torch.Generator().manual_seed(0), "bf16").items())
    log: list[str] = []
    buffer = layer.buffer
    dispatch, combine = buffer.low_latency_dispatch, buffer.low_latency_combine

    def logged(kind: str, fn):
        def call(x, *args, **kwargs):
            mb = "AB"[len([e for e in log if e.startswith(kind + " send")]) % 2]
            *rest, hook = fn(x, *args, **kwargs)
            log.append(f"{kind} send {mb}")

            def logged_hook() -> None:
                log.append(f"{kind} hook {mb}")
                hook()
            return (*rest, logged_hook)
        return call

    buffer.low_latency_dispatch = logged("dispatch", dispatch)
    buffer.low_latency_combine = logged("combine", combine)
    experts, shared, route = layer.run_experts, layer.shared_expert, layer.route
    layer.route = lambda x: (log.append("route"), route(x))[1]
    layer.run_experts = lambda *a: (log.append("experts"), experts(*a))[1]
    layer.shared_expert = lambda x: (log.append("shared"), shared(x))[1]
    x = torch.randn(7, cfg.hidden).to(torch.bfloat16)
    overlapped = layer.forward_two_microbatches(x)
    assert log == ["route", "route", "dispatch send A", "dispatch send B",
                   "shared", "dispatch hook A", "experts", "combine send A", "combine hook A",
                   "dispatch hook B", "experts", "combine send B", "shared", "combine hook B"]
    # In this process torch may use several threads; still bit for bit.
    assert torch.equal(overlapped, layer(x))


def test_forward_two_microbatches_of_several_layers_through_depth() -> None:
    """The module-level overlapped forward (what bench_moe and the GPU graph tests run on emulated ranks): two
    single-rank layers with their own inputs (odd and one token), each through two calls in a row, equal to
    calling each layer twice, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    cfg = MoeConfig(max_tokens=8)
    layers = []
    for _ in range(2):
        layer = cfg.layer(None, "bf16")
        layer.load_weights(hf_weights(cfg, gen, "bf16").items())
        layers.append(layer)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16) for n in (7, 1)]
    got = forward_two_microbatches(layers, xs, None, depth=2)
    for layer, x, out in zip(layers, xs, got, strict=True):
        assert torch.equal(out, layer(layer(x)))


def test_two_microbatch_schedule_of_emulated_ranks() -> None:
    """run_two_microbatches with two ranks per micro-batch, through two layers: both micro-batches route
    before either sends a dispatch; every rank's send of a call comes before any hook of it (ranks sharing
    a stream never wait for a send queued behind them), each of micro-batch A's hooks comes before B's
    send of that op (on a side stream it runs right after A's send instead of behind B's), and every
    rank's shared expert comes before any rank's next step (A: its experts, B: its combine hook)."""
    log: list[str] = []

    def layer(name: str, shared_under: str) -> Steps[str]:
        log.append(f"{name} route")
        yield ROUTED
        log.append(f"{name} dispatch send")
        yield DISPATCH_SENT
        log.append(f"{name} dispatch hook")
        yield DISPATCH_HOOKED
        if shared_under == "dispatch":
            log.append(f"{name} shared")
            yield SHARED_QUEUED
        log.append(f"{name} combine send")
        yield COMBINE_SENT
        if shared_under == "combine":
            log.append(f"{name} shared")
            yield SHARED_QUEUED
        log.append(f"{name} combine hook")
        yield COMBINE_HOOKED
        return name

    def two_layers(mb: str, rank: int) -> Steps[str]:
        shared_under = "dispatch" if mb == "A" else "combine"
        yield from layer(f"{mb}{rank}.1", shared_under)
        return (yield from layer(f"{mb}{rank}.2", shared_under))

    first, second = run_two_microbatches([two_layers("A", r) for r in range(2)],
                                         [two_layers("B", r) for r in range(2)])
    assert (first, second) == (["A0.2", "A1.2"], ["B0.2", "B1.2"])

    def turn(mb: str, depth: int, *events: str) -> list[str]:  # one step of both ranks of a micro-batch
        return [f"{mb}{rank}.{depth} {event}" for rank in range(2) for event in events]

    want = []
    for depth in (1, 2):
        want += turn("A", depth, "route") + turn("B", depth, "route")
        want += turn("A", depth, "dispatch send") + turn("A", depth, "dispatch hook")
        want += turn("B", depth, "dispatch send") + turn("B", depth, "dispatch hook")
        want += turn("A", depth, "shared") + turn("A", depth, "combine send") + turn("A", depth, "combine hook")
        want += turn("B", depth, "combine send") + turn("B", depth, "shared") + turn("B", depth, "combine hook")
    assert log == want


# ---------------------------------------------------------------------------- expert kernels
@pytest.mark.parametrize("fp8", [False, True])
def test_torch_experts_on_ragged_rows(fp8: bool, seed: int) -> None:
    """Rows past recv_count are garbage (NaN) and must not leak; counts 0, full and ragged."""
    gen = torch.Generator().manual_seed(seed)
    num_experts, rows, hidden, inter = 4, 3 * ROW_TILE + 5, 256, 192
    cfg = MoeConfig(num_experts=num_experts, hidden=hidden, intermediate=inter, n_group=1, topk_group=1)
    weights = hf_weights(cfg, gen, "fp8" if fp8 else "bf16")
    store = ExpertWeights(num_experts, hidden, inter, fp8)
    for e in range(num_experts):
        for p in ("gate", "up", "down"):
            weight_slot(store, e, p).copy_(weights[f"experts.{e}.{p}_proj.weight"])
            if fp8:
                scale_slot(store, e, p).copy_(weights[f"experts.{e}.{p}_proj.weight_scale_inv"])
    counts = torch.tensor([0, rows, int(torch.randint(1, rows, (1,), generator=gen)), 1], dtype=torch.int32)
    x = torch.full((num_experts, rows, hidden), float("nan"), dtype=torch.bfloat16)
    for e, n in enumerate(counts.tolist()):
        x[e, :n] = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    inputs = x
    if fp8:  # as dispatch delivers them: column-major scales; the oracle sees the dequantised rows
        data, scales = per_token_cast_to_fp8(x.view(-1, hidden))
        scales = scales.view(num_experts, rows, -1)
        inputs = (data.view(x.shape), scales.transpose(1, 2).contiguous().transpose(1, 2))
        x = (data.float().view(num_experts, rows, -1, 128) * scales.unsqueeze(-1)).view(x.shape)
    out = TorchExperts()(inputs, counts, store)
    assert out.shape == (num_experts, rows, hidden) and out.dtype == torch.bfloat16
    for e, n in enumerate(counts.tolist()):
        want = mlp_float64(x[e, :n].double().numpy(), dense_weights(weights, f"experts.{e}"))
        got = out[e, :n].double()
        err = (got - torch.from_numpy(want)).norm() / max(np.linalg.norm(want), 1e-30)
        bound = TOL_FP8_RMS if fp8 else 2.0 ** -7  # bf16: two roundings of 2**-9 each, and margin
        assert err <= bound, f"seed={seed} expert {e} ({n} rows): relative error {err:.4f}"
        assert not got.isnan().any(), f"seed={seed} expert {e}: garbage rows leaked"


@pytest.mark.parametrize("fp8", [False, True])
def test_shared_mlp_in_two_halves_is_the_routed_mlp(fp8: bool, seed: int) -> None:
    """dense_gate_up then dense_down (the shared expert split around the combine) equal, bit for bit, the
    routed experts' MLP on the same rows cast as dispatch casts them; 0, 1 and several tiles of rows. And
    the layer gives the same output whichever exchange its shared expert runs under."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 256, 192
    cfg = MoeConfig(num_experts=1, hidden=hidden, intermediate=inter, n_group=1, topk_group=1)
    weights = hf_weights(cfg, gen, "fp8" if fp8 else "bf16")
    store = ExpertWeights(1, hidden, inter, fp8)
    for p in ("gate", "up", "down"):
        weight_slot(store, 0, p).copy_(weights[f"experts.0.{p}_proj.weight"])
        if fp8:
            scale_slot(store, 0, p).copy_(weights[f"experts.0.{p}_proj.weight_scale_inv"])
    kernels = TorchExperts()
    for rows in (0, 1, 2 * ROW_TILE + 3):
        x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
        count = torch.tensor([rows], dtype=torch.int32)
        routed = kernels(kernels.cast_to_fp8(x[None], count) if fp8 else x[None], count, store)[0]
        act = kernels.dense_gate_up(x, store)
        assert act.shape == (rows, store.padded_intermediate) and act.dtype == torch.bfloat16
        assert torch.equal(kernels.dense_down(act, store), routed), f"seed={seed} rows={rows}"
        assert torch.equal(kernels.dense_mlp(x, store), routed), f"seed={seed} rows={rows}"

    layer, weights = _layer("fp8-block" if fp8 else "bf16")
    layer.load_weights(weights.items())
    x = torch.randn(7, 256, generator=gen).to(torch.bfloat16)
    outs = [run_to_end(layer.steps(x, shared_under=under)) for under in ("both", "dispatch", "combine")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), f"seed={seed}"
    assert torch.equal(layer(x), outs[0])


class _CastActivationExperts(TorchExperts):
    """TorchExperts whose dense_gate_up hands dense_down its activation as a pair (as the Triton kernels hand the
    FP8 cast of theirs), to run FusedMoE's shared expert on that contract on CPU."""

    def dense_gate_up(self, x: torch.Tensor, weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
        act = super().dense_gate_up(x, weights)
        return act, torch.ones(act.shape[0], 1)

    def dense_down(self, act: tuple[torch.Tensor, torch.Tensor], weights: ExpertWeights) -> torch.Tensor:
        rows, ones = act
        return super().dense_down(rows * ones.to(rows.dtype), weights)


def test_the_layer_runs_a_shared_activation_handed_over_as_a_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """ExpertKernels.dense_gate_up may hand dense_down a pair (the Triton kernels' FP8 rows and scales): the
    layer's shared expert passes it on, and its output is the same."""
    layer, weights = _layer("fp8-block")
    layer.load_weights(weights.items())
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = layer(x)
    monkeypatch.setattr(layer, "_kernels", {x.device: _CastActivationExperts()})
    assert torch.equal(layer(x), want)


def test_expert_kernel_selection() -> None:
    from ep_layer.kernels import triton_support

    assert isinstance(make_expert_kernels("auto", torch.device("cpu")), TorchExperts)
    if not triton_support.available():
        with pytest.raises(ValueError, match="triton"):
            make_expert_kernels("triton", torch.device("cuda"))
    with pytest.raises(ValueError, match="expert_kernels"):
        make_expert_kernels("cutlass", torch.device("cpu"))


def test_block_fp8_round_trip(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 200, generator=gen) * torch.rand(300, 1, generator=gen) * 10
    data, scale_inv = block_cast_to_fp8(w)
    assert data.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = block_dequant(data, scale_inv)
    np.testing.assert_array_equal(back.double().numpy(), dequant_loop(data, scale_inv).astype(np.float32))
    # e4m3 rounding: at most 2**-4 relative for normal values, plus subnormal steps of the block
    step = 2.0 ** -9 * scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert bool(((back - w).abs() <= 2.0 ** -4 * w.abs() + step).all()), f"seed={seed}"


# ---------------------------------------------------------------------------- load_weights and inputs
def _layer(quant: str = "bf16", **kwargs) -> tuple[FusedMoE, dict[str, torch.Tensor]]:
    cfg = MoeConfig(num_experts=8, n_group=4, topk_group=2, max_tokens=8, intermediate=64, **kwargs)
    weights = hf_weights(cfg, torch.Generator().manual_seed(1), "bf16" if quant == "bf16" else "fp8")
    return cfg.layer(None, quant), weights


@pytest.mark.parametrize(("quant", "change", "match"), [
    ("bf16", lambda w: w.pop("experts.3.up_proj.weight"), "1 tensor.*missing: experts.3.up_proj.weight"),
    ("bf16", lambda w: w.pop("gate.e_score_correction_bias"), "missing: gate.e_score_correction_bias"),
    ("fp8-block", lambda w: w.pop("shared_experts.down_proj.weight_scale_inv"),
     "missing: shared_experts.down_proj.weight_scale_inv"),
    ("bf16", lambda w: w.update({"experts.0.gate_proj.bias": torch.zeros(64)}),
     "unexpected tensor experts.0.gate_proj.bias"),
    ("bf16", lambda w: w.update({"experts.8.gate_proj.weight": torch.zeros(64, 256)}), "expert 8 does not exist"),
    ("bf16", lambda w: w.update({"mlp.gate.weight": torch.zeros(8, 256)}), "relative to the layer's `mlp.`"),
    ("bf16", lambda w: w.update({"experts.1.gate_proj.weight_scale_inv": torch.ones(1, 2)}), "quant='fp8-block'"),
    ("bf16", lambda w: w.update({"gate.weight": torch.zeros(8, 128)}), r"gate.weight: expected shape \[8, 256\]"),
    ("bf16", lambda w: w.update({"experts.2.down_proj.weight": torch.zeros(64, 256)}),
     r"experts.2.down_proj.weight: expected shape \[256, 64\], got \[64, 256\]"),
    ("fp8-block", lambda w: w.update({"experts.2.up_proj.weight_scale_inv": torch.ones(2, 2)}),
     r"experts.2.up_proj.weight_scale_inv: expected shape \[1, 2\]"),
    ("fp8-block", lambda w: w.update({"experts.5.gate_proj.weight": torch.zeros(64, 256, dtype=torch.bfloat16)}),
     "expected dtype torch.float8_e4m3fn"),
    ("bf16", lambda w: w.update({"experts.5.gate_proj.weight": torch.zeros(64, 256, dtype=torch.float8_e4m3fn)}),
     "needs quant='fp8-block'"),
    ("bf16", lambda w: w.update({"experts.5.gate_proj.weight": torch.zeros(64, 256, dtype=torch.int32)}),
     "expected a bf16, fp16 or fp32 tensor"),
])
def test_load_weights_errors(quant: str, change, match: str) -> None:
    layer, weights = _layer(quant)
    change(weights)
    with pytest.raises(ValueError, match=match):
        layer.load_weights(weights.items())


def test_load_weights_duplicate_and_no_shared() -> None:
    layer, weights = _layer()
    items = list(weights.items())
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight given twice"):
        layer.load_weights([*items, ("experts.0.gate_proj.weight", weights["experts.0.gate_proj.weight"])])
    bare, _ = _layer(n_shared_experts=0)
    with pytest.raises(ValueError, match="no shared experts"):
        bare.load_weights(items)
    bare.load_weights((n, t) for n, t in items if not n.startswith("shared_experts."))
    assert bare(torch.randn(3, 256).to(torch.bfloat16)).shape == (3, 256)


def test_load_weights_places_tensors() -> None:
    """Each HF tensor lands where the kernels read it (gate rows, then up rows at the padded offset)."""
    layer, weights = _layer("fp8-block")
    layer.load_weights(weights.items())
    store = layer.experts
    assert store.gate_up.shape == (8, 256, 256)  # intermediate 64 padded to 128 for gate and for up
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    assert same(store.gate_up[3, :64], weights["experts.3.gate_proj.weight"])
    assert same(store.gate_up[3, 128:192], weights["experts.3.up_proj.weight"])
    assert not store.gate_up[3, 64:128].float().any() and not store.down[3, :, 64:].float().any()
    assert torch.equal(store.gate_up_scale[3, 1], weights["experts.3.up_proj.weight_scale_inv"][0])
    assert torch.equal(layer.gate_weight, weights["gate.weight"].float())


def test_bad_inputs_and_arguments() -> None:
    layer, weights = _layer()
    layer.load_weights(weights.items())
    for bad in (torch.randn(3, 256), torch.randn(3, 128).to(torch.bfloat16), torch.randn(9, 256).to(torch.bfloat16),
                [[0.0] * 256]):
        with pytest.raises(ValueError, match="hidden_states"):
            layer(bad)
        with pytest.raises(ValueError, match="hidden_states"):
            layer.forward_two_microbatches(bad)
    with pytest.raises(ValueError, match="shared_under"):
        next(layer.steps(torch.randn(2, 256).to(torch.bfloat16), shared_under="gate"))
    buffer = Buffer(None, low_latency_mode=True, backend="reference")
    base = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0, "buffer": buffer}
    for kwargs, match in (({"quant": "int4"}, "quant"), ({"max_tokens_per_rank": 2048}, "max_tokens_per_rank"),
                          ({"expert_kernels": "cutlass"}, "expert_kernels")):
        with pytest.raises(ValueError, match=match):
            FusedMoE(8, 2, 256, 64, None, **(base | kwargs))
    with pytest.raises(ValueError, match="multiple of 128"):
        FusedMoE(8, 2, 200, 64, None, **(base | {"quant": "fp8-block"}))
    assert not layer.rows_in_place(torch.device("cpu"))  # the reference backend copies the rows


def test_rows_in_place_are_checked_against_the_weights() -> None:
    """Dispatch's rows in place (the cuda backend's) go only to expert kernels that read them there, and
    are checked against the experts' shapes and quantisation (the checks themselves need no GPU)."""
    e, m, h = 4, 8, 256
    store = ExpertWeights(e, h, 64, True, "cpu")
    count = torch.zeros(e, dtype=torch.int32)
    good = RowsInPlace(torch.zeros(16, dtype=torch.uint8), torch.zeros(e, m, dtype=torch.int64),
                       torch.zeros(e, m, h // 128), h)
    assert check_rows_in_place(good, count, store) == (e, m)
    with pytest.raises(ValueError, match=r"^x: .*triton"):
        TorchExperts()(good, count, store)
    for bad in (replace(good, offsets=good.offsets.int()), replace(good, offsets=good.offsets[:3]),
                replace(good, hidden=128), replace(good, scales=None), replace(good, scales=good.scales[..., :1])):
        with pytest.raises(ValueError, match=r"^x: "):
            check_rows_in_place(bad, count, store)
    with pytest.raises(ValueError, match=r"^recv_count: "):
        check_rows_in_place(good, count[:3], store)
