"""serving.models.rotary_triton's one-kernel RoPE against RotaryEmbedding.rotate's PyTorch ops (the same
call with the kernel switched off; those ops are checked against transformers in test_serving_model.py),
bit for bit, on random inputs laid out as MLA's q_pe (a slice of each head) and k_pe (a slice of each
row). Skipped without a GPU and Triton."""

from __future__ import annotations

import pytest
import torch

from serving.models import rotary_triton
from serving.models.rotary import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not rotary_triton.available(), reason="needs a CUDA GPU and Triton"),
]


def pytorch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                   monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(rotary_triton, "available", lambda: False)
        return RotaryEmbedding.rotate(x, cos, sin, interleave)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "rope_dim"), [(1, 128, 64), (33, 128, 64), (5, 3, 24), (2, 17, 16)])
def test_rotate_matches_pytorch_bit_for_bit(tokens: int, heads: int, rope_dim: int, interleave: bool,
                                            dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens * 1000 + heads * 10 + rope_dim)
    nope = 128
    q = torch.randn(tokens, heads, nope + rope_dim, device="cuda", generator=gen).to(dtype)
    q_pe = q[..., nope:]  # strided: a slice of each head
    kv = torch.randn(tokens, 512 + rope_dim, device="cuda", generator=gen).to(dtype)
    k_pe = kv[:, 512:]  # strided: a slice of each row
    angles = torch.rand(tokens, rope_dim // 2, device="cuda", generator=gen) * 100
    cos, sin = (angles.cos() * 1.2).to(dtype), (angles.sin() * 1.2).to(dtype)
    for x in (q_pe, k_pe):
        got = RotaryEmbedding.rotate(x, cos, sin, interleave)
        want = pytorch_rotate(x, cos, sin, interleave, monkeypatch)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_rotate_empty_and_bad_input() -> None:
    cos = torch.zeros(0, 32, dtype=torch.bfloat16, device="cuda")
    assert rotary_triton.rotate(torch.zeros(0, 4, 64, dtype=torch.bfloat16, device="cuda"), cos, cos, True).shape == \
        (0, 4, 64)
    x = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="cos"):
        rotary_triton.rotate(x, torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda"), cos, True)
    with pytest.raises(ValueError, match="x"):
        rotary_triton.rotate(torch.zeros(2, 4, 63, dtype=torch.bfloat16, device="cuda"), cos, cos, True)
