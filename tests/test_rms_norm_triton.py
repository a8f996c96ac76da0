"""serving.models.rms_norm_triton's one-kernel RMSNorm against RMSNorm's PyTorch path (the same module with
the kernel switched off) and against float64 math, on random rows. Only the order of the sum of squares
differs from PyTorch's, which moves an output by one unit in the last place where x * rsqrt lies on a
rounding boundary: almost never. Skipped without a GPU and Triton."""

from __future__ import annotations

import pytest
import torch

from serving.models import rms_norm_triton
from serving.models.norm import RMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not rms_norm_triton.available(), reason="needs a CUDA GPU and Triton"),
]


def pytorch_norm(norm: RMSNorm, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(rms_norm_triton, "available", lambda: False)
        return norm(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("dim", "rows"), [(7168, 1), (7168, 33), (1536, 17), (512, 64), (1000, 5), (64, 3)])
def test_rms_norm_matches_pytorch_and_float64(dim: int, rows: int, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(dim * 100 + rows)
    norm = RMSNorm(dim, 1e-6, dtype=dtype, device="cuda")
    norm.weight.copy_(torch.rand(dim, device="cuda", generator=gen) + 0.5)
    scale = torch.rand(rows, 1, device="cuda", generator=gen) * 10  # rows of different magnitudes
    x = (torch.randn(rows, dim, device="cuda", generator=gen) * scale).to(dtype)
    got = norm(x)
    want = pytorch_norm(norm, x, monkeypatch)
    assert got.dtype == dtype and got.shape == x.shape
    info = torch.finfo(dtype)
    rtol = max(2 * info.eps, 2.0 ** -20)  # float32: rsqrt (~2 ulps, as PyTorch's) and the mean set the error
    atol = 2 * info.tiny * info.eps  # float16's outputs below its normal range lie on a fixed grid
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    if dtype != torch.float32:  # the rounding to dtype hides the float32 sum's order but at a boundary
        assert (got != want).float().mean().item() <= 1e-3
    h = x.double()
    exact = norm.weight.double() * h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=atol)


def test_rms_norm_strided_rows_and_leading_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice of wider rows (MLA normalises c_kv, the first 512 of 576 channels) and a 3-d input."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    norm = RMSNorm(512, 1e-6, dtype=torch.bfloat16, device="cuda")
    norm.weight.copy_(torch.rand(512, device="cuda", generator=gen) + 0.5)
    wide = torch.randn(9, 576, device="cuda", generator=gen).to(torch.bfloat16)
    assert torch.equal(norm(wide[:, :512]), norm(wide[:, :512].contiguous()))
    torch.testing.assert_close(norm(wide[:, :512]), pytorch_norm(norm, wide[:, :512], monkeypatch),
                               rtol=2 ** -7, atol=0)
    cube = torch.randn(2, 3, 512, device="cuda", generator=gen).to(torch.bfloat16)
    assert torch.equal(norm(cube), norm(cube.reshape(6, 512)).reshape(2, 3, 512))


def test_rms_norm_empty_and_bad_weight() -> None:
    weight = torch.ones(64, dtype=torch.bfloat16, device="cuda")
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    assert rms_norm_triton.rms_norm(empty, weight, 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton.rms_norm(torch.zeros(2, 32, dtype=torch.bfloat16, device="cuda"), weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton.rms_norm(torch.zeros(2, 64, dtype=torch.float16, device="cuda"), weight, 1e-6)
