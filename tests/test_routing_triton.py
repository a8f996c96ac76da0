"""ep_layer.moe.triton_routing's one-kernel `noaux_tc` against routing.noaux_tc_route (itself checked against
transformers' DeepseekV3 router in test_moe.py), on random logits and random non-zero correction biases; and
its whole routing (for a few tokens the split GEMV's logits, whose parts the selection adds) against
routing.route on inputs whose float32 logits are exact in any summation order.

The experts must be the same, in the same order (random float32 scores do not tie). The weights may differ
only in the order of the final k-term sum: a few float32 ulps (rtol 1e-6 is ~8 of them). Skipped without a
GPU and Triton.
"""

from __future__ import annotations

import pytest
import torch

from ep_layer.kernels import triton_support
from ep_layer.moe import RoutingConfig, noaux_tc_route, route
from ep_layer.moe.triton_routing import noaux_tc_route as fused_noaux_tc_route
from ep_layer.moe.triton_routing import route as fused_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason()),
]

CONFIGS = {
    "deepseek-v3": RoutingConfig(256, 8, n_group=8, topk_group=4, routed_scaling_factor=2.5),
    "tiny": RoutingConfig(16, 4, n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "padded groups and experts": RoutingConfig(72, 6, n_group=3, topk_group=2, routed_scaling_factor=1.0),
    "all groups kept": RoutingConfig(64, 8, n_group=4, topk_group=4, routed_scaling_factor=2.0),
    "one group": RoutingConfig(32, 3, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    "no normalization": RoutingConfig(64, 6, n_group=8, topk_group=3, routed_scaling_factor=16.0,
                                      norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_fused_routing_matches_pytorch(name: str, tokens: int) -> None:
    config = CONFIGS[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens * 100 + len(name))
    logits = torch.randn(tokens, config.num_experts, device="cuda", generator=gen) * 3
    bias = torch.randn(config.num_experts, device="cuda", generator=gen) * 0.5
    want_idx, want_weights = noaux_tc_route(logits, bias, config)
    got_idx, got_weights = fused_noaux_tc_route(logits, bias, config)
    assert got_idx.dtype == torch.int64 and got_weights.dtype == torch.float32
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=0)


def test_fused_routing_keeps_whole_groups() -> None:
    """A group with one huge-scoring expert and weak others loses to groups of two good ones: the group
    rule, not the plain top-k, decides (a kernel that skipped the group step would pick the huge one)."""
    config = RoutingConfig(16, 2, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    logits = torch.full((1, 16), -4.0, device="cuda")
    logits[0, 0] = 8.0  # group 0: one strong expert, three weak: group score ~1.02
    logits[0, [4, 5, 8, 9]] = torch.tensor([2.0, 1.9, 2.1, 1.8], device="cuda")  # groups 1, 2: ~1.75 each
    bias = torch.zeros(16, device="cuda")
    got_idx, _ = fused_noaux_tc_route(logits, bias, config)
    want_idx, _ = noaux_tc_route(logits, bias, config)
    assert torch.equal(got_idx, want_idx)
    assert got_idx.tolist() == [[8, 4]]


def test_fused_routing_empty_batch_and_bad_logits() -> None:
    config = CONFIGS["tiny"]
    bias = torch.zeros(16, device="cuda")
    idx, weights = fused_noaux_tc_route(torch.empty(0, 16, device="cuda"), bias, config)
    assert idx.shape == (0, 4) and weights.shape == (0, 4)
    with pytest.raises(ValueError, match="logits"):
        fused_noaux_tc_route(torch.zeros(2, 32, device="cuda"), bias, config)


def test_fused_routing_never_picks_nan_or_out_of_range() -> None:
    """A token whose logits are partly or wholly NaN still gets top_k expert indices in range."""
    config = CONFIGS["deepseek-v3"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(3, 256, device="cuda", generator=gen)
    logits[0, :100] = float("nan")
    logits[1] = float("nan")
    idx, _ = fused_noaux_tc_route(logits, torch.zeros(256, device="cuda"), config)
    assert ((idx >= 0) & (idx < 256)).all()
    assert not any(e < 100 for e in idx[0].tolist())  # the finite experts win over NaN ones
    want, _ = noaux_tc_route(logits[2:], torch.zeros(256, device="cuda"), config)
    assert torch.equal(idx[2:], want)


@pytest.mark.parametrize(("name", "hidden"), [("deepseek-v3", 7168), ("padded groups and experts", 1000),
                                              ("tiny", 64)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 100])
def test_fused_route_matches_pytorch(name: str, hidden: int, tokens: int) -> None:
    """Tokens in bf16 of small integers and router weights on a 2**-12 grid: every partial sum of a logit is
    exact in float32, so the logits' parts must add up to PyTorch's logits bit for bit and give the same
    experts (random correction biases keep the biased scores apart) and weights. Up to 16 tokens the GEMV
    computes the parts (hidden sizes that are and are not a multiple of its 512-channel parts; 256, 72
    and 16 experts, 4 per program), past that cuBLAS's batched GEMM (28 parts of 256 channels at 7168, one
    part where the hidden size is not a multiple of 256)."""
    config = CONFIGS[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens * 1000 + hidden)
    x = torch.randint(-4, 5, (tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.randint(-8, 9, (config.num_experts, hidden), device="cuda", generator=gen).float() / 4096
    bias = torch.randn(config.num_experts, device="cuda", generator=gen) * 0.01
    want_idx, want_weights = route(x, weight, bias, config)
    got_idx, got_weights = fused_route(x, weight, bias, config)
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=0)


def test_fused_route_empty_batch_and_bad_weight() -> None:
    config = CONFIGS["tiny"]
    bias = torch.zeros(16, device="cuda")
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    idx, weights = fused_route(x, torch.zeros(16, 64, device="cuda"), bias, config)
    assert idx.shape == (0, 4) and weights.shape == (0, 4)
    with pytest.raises(ValueError, match="gate_weight"):
        fused_route(torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda"), torch.zeros(16, 32, device="cuda"),
                    bias, config)
