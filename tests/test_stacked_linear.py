"""StackedLinear: parts that load by their own names into one stacked weight, and one GEMM for all of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ep_layer.block_fp8 import block_cast_to_fp8
from ep_layer.kernels import triton_support
from serving.models.linear import GateUpLinear, StackedLinear


class Holder(nn.Module):
    """Registers a StackedLinear's parts under their own names, as MLAttention does."""

    def __init__(self, stacked: StackedLinear) -> None:
        super().__init__()
        self.fused = stacked
        self.first, self.second = stacked.parts


def fill(holder: Holder, gen: torch.Generator, fp8: bool) -> None:
    """Random weights (FP8: with random block scales) loaded through the parts' state_dict names."""
    for name in ("first", "second"):
        part = getattr(holder, name)
        weight = torch.randn(part.out_features, part.in_features, generator=gen, dtype=torch.float64)
        if fp8:
            data, scale = block_cast_to_fp8(weight)
            holder.load_state_dict({f"{name}.weight": data, f"{name}.weight_scale_inv": scale}, strict=False)
        else:
            holder.load_state_dict({f"{name}.weight": weight}, strict=False)


@pytest.mark.parametrize("sizes", [(96, 96), (128, 64), (1536, 576), (5, 3)])
def test_parts_load_into_the_stacked_weight_and_share_one_gemm(sizes: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    holder = Holder(StackedLinear(256, sizes, fp8=False, dtype=torch.float64))
    assert set(holder.state_dict()) == {"first.weight", "second.weight"}
    fill(holder, gen, fp8=False)
    x = torch.randn(7, 256, generator=gen, dtype=torch.float64)
    outs = holder.fused(x)
    assert [o.shape for o in outs] == [(7, n) for n in sizes]
    for out, part in zip(outs, (holder.first, holder.second)):
        torch.testing.assert_close(out, x @ part.weight.T, rtol=1e-12, atol=1e-12)
    assert holder.fused.stacked.weight.shape == (sum(sizes), 256)  # no padding without block scales


@pytest.mark.parametrize("sizes", [(96, 96), (128, 64), (200, 50)])
def test_fp8_parts_start_on_a_scale_block(sizes: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    stacked = StackedLinear(384, sizes, fp8=True, dtype=torch.float32)
    holder = Holder(stacked)
    fill(holder, gen, fp8=True)
    second_start = -(-sizes[0] // 128) * 128
    assert stacked.starts == [0, second_start]
    dense = stacked.stacked.dense_weight(torch.float32)
    assert dense.shape == (second_start + -(-sizes[1] // 128) * 128, 384)
    assert torch.equal(dense[:sizes[0]], holder.first.dense_weight(torch.float32))
    assert torch.equal(dense[second_start:second_start + sizes[1]], holder.second.dense_weight(torch.float32))
    assert not dense[sizes[0]:second_start].any() and not dense[second_start + sizes[1]:].any()  # zero padding
    x = torch.randn(3, 384, generator=gen)
    for out, part in zip(stacked(x), (holder.first, holder.second)):
        torch.testing.assert_close(out, part(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("fp8", "intermediate"), [(False, 96), (True, 96), (True, 256)])
def test_gate_up_is_silu_of_gate_times_up(fp8: bool, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(intermediate)
    dtype = torch.float32 if fp8 else torch.float64
    gate_up = GateUpLinear(256, intermediate, fp8=fp8, dtype=dtype)
    holder = Holder(gate_up)
    fill(holder, gen, fp8)
    x = torch.randn(5, 256, generator=gen, dtype=dtype)
    want = torch.nn.functional.silu(holder.first(x)) * holder.second(x)
    got = gate_up(x)
    assert got.shape == (5, intermediate)
    torch.testing.assert_close(got, want, rtol=1e-5 if fp8 else 1e-12, atol=1e-5 if fp8 else 1e-12)
    assert gate_up.stacked.out_features == 2 * gate_up.starts[1]  # gate and up halves of one height


def test_a_replaced_part_weight_is_an_error() -> None:
    holder = Holder(StackedLinear(64, (32, 16), fp8=False, dtype=torch.float32))
    holder.load_state_dict({"first.weight": torch.ones(32, 64), "second.weight": torch.ones(16, 64)},
                           strict=False, assign=True)  # new tensors: the stacked weight no longer sees them
    with pytest.raises(RuntimeError, match="a part's weight is no longer a slice"):
        holder.fused(torch.ones(2, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason())
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("sizes,hidden", [((1536, 576), 7168), ((96, 96), 256)])
def test_fp8_stacked_gemm_on_gpu_matches_the_parts(rows: int, sizes: tuple[int, int], hidden: int) -> None:
    """One FP8 GEMM for both parts against each part's own (the same FP8 cast of x; the split-K GEMM may
    split K differently, so within float32 summation order, then a bf16 rounding)."""
    gen = torch.Generator().manual_seed(rows)
    stacked = StackedLinear(hidden, sizes, fp8=True, dtype=torch.bfloat16, device="cuda")
    holder = Holder(stacked)
    fill(holder, gen, fp8=True)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
    for out, part in zip(stacked(x), (holder.first, holder.second)):
        want = part(x).float()
        assert out.dtype == torch.bfloat16
        assert ((out.float() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason())
@pytest.mark.parametrize("rows", [1, 40, 300])
@pytest.mark.parametrize("intermediate,hidden", [(2048, 7168), (96, 256)])
def test_fp8_gate_up_on_gpu_matches_the_parts(rows: int, intermediate: int, hidden: int) -> None:
    """The gated FP8 GEMM (SiLU * up from the float32 sums) against SiLU(gate) * up of each part's own
    FP8 GEMM output (bf16), in float32: within the parts' bf16 rounding."""
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = GateUpLinear(hidden, intermediate, fp8=True, dtype=torch.bfloat16, device="cuda")
    holder = Holder(gate_up)
    fill(holder, gen, fp8=True)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
    want = torch.nn.functional.silu(holder.first(x).float()) * holder.second(x).float()
    got = gate_up(x)
    assert got.shape == (rows, intermediate) and got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 8e-3
