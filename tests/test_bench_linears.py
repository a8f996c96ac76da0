"""benchmarks/bench_linears.py's parts that run on CPU: its float64 reference against a block-by-block sum of
the quantized products, its byte count, and the sweep's configurations and their restore."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbours bench_ll and bench_moe by name

import bench_linears as bench  # noqa: E402

from ep_layer.block_fp8 import WEIGHT_BLOCK, block_cast_to_fp8  # noqa: E402
from ep_layer.kernels import fp8_linear  # noqa: E402
from ep_layer.quant import per_token_cast_to_fp8  # noqa: E402


def blockwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 x @ weight.T summed one (128 x 128) block at a time, each block's integer-valued e4m3 products
    scaled by the token's and the weight block's scales."""
    data, scales = per_token_cast_to_fp8(x)
    rows, cols = weight.shape
    out = torch.zeros(x.shape[0], rows, dtype=torch.float64)
    for kb in range(cols // WEIGHT_BLOCK):
        k = slice(kb * WEIGHT_BLOCK, (kb + 1) * WEIGHT_BLOCK)
        for nb in range(-(-rows // WEIGHT_BLOCK)):
            n = slice(nb * WEIGHT_BLOCK, (nb + 1) * WEIGHT_BLOCK)
            product = data[:, k].double() @ weight[n, k].double().T
            out[:, n] += product * scales[:, kb, None].double() * scale_inv[nb, kb].double()
    return out


@pytest.mark.parametrize("gated", (False, True))
def test_reference_is_the_blockwise_sum_of_the_quantized_operands(gated: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, cols, tokens = (256, 256, 3) if gated else (384, 256, 3)  # gated: 128 gate rows, then 128 up rows
    weight, scale_inv = block_cast_to_fp8(torch.randn(rows, cols, generator=gen) * 0.05)
    x = torch.randn(tokens, cols, generator=gen).to(torch.bfloat16)
    projection, ops = bench.Projection("p", rows, cols, gated), bench.Operands(x, [(weight, scale_inv)])
    want = blockwise(x, weight, scale_inv)
    if gated:
        gate, up = want.chunk(2, dim=1)
        want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(bench.reference(projection, ops), want, rtol=1e-12, atol=1e-12)
    out_bytes = 2 * tokens * (rows // 2 if gated else rows)
    assert ops.bytes_per_call(projection) == weight.numel() + 4 * scale_inv.numel() + 2 * x.numel() + out_bytes


def test_sweep_configurations_are_valid_and_restored() -> None:
    configs = bench.sweep_configs()
    assert len(configs) == len({tuple(c.values()) for c in configs})
    for config in configs:
        assert set(config) == set(bench.TUNABLES)
        assert WEIGHT_BLOCK % config["SPLITK_BLOCK_N"] == 0  # a column tile within one weight block's scales
    own = {name: getattr(fp8_linear, name) for name in bench.TUNABLES}
    with pytest.raises(RuntimeError), bench.tunables(configs[-1]):
        assert {name: getattr(fp8_linear, name) for name in bench.TUNABLES} == configs[-1]
        raise RuntimeError
    assert {name: getattr(fp8_linear, name) for name in bench.TUNABLES} == own
