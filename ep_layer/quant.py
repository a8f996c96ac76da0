"""FP8 per-token, per-128-channel cast (docs/design.md section 2) and its inverse.

All arithmetic is IEEE float32 so that every backend (this file, the CUDA kernels) produces the
same bytes: amax = max(max|x|, 1e-4); scale = amax / 448 (or its power-of-two ceiling);
data = e4m3(x / scale), rounded to nearest even and saturated at +-448.

The rule's constants below are its one home: the Triton cast (kernels/fp8_cast.py) and the tests'
oracle import them, and the CUDA kernels' own (csrc/ll_common.cuh) are checked against them when
ep_layer._C loads (native.py).
"""

from __future__ import annotations

import torch

FP8_GROUP = 128          # channels sharing one scale
UE8M0_PACK = 4           # 8-bit exponents packed per int32
FP8_MAX = 448.0          # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4        # keeps all-zero groups finite


def ceil_pow2(q: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(q)) for positive float32 q, exactly (no log, no rounding)."""
    mantissa, exponent = torch.frexp(q)  # q = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(q), exponent)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False,
                          use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `x` [N, H] to (float8_e4m3fn [N, H], scales).

    Scales are float32 [N, H/128] (row-major), or with `use_ue8m0` int32 [N, H/512] holding four
    biased 8-bit exponents each (group g in byte g % 4 of int g // 4).
    """
    n, h = x.shape
    if h % FP8_GROUP:
        raise ValueError(f"x: hidden size must be a multiple of {FP8_GROUP} for FP8, got {h}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 stores powers of two)")
    if use_ue8m0 and h % (FP8_GROUP * UE8M0_PACK):
        raise ValueError(f"x: hidden size must be a multiple of 512 for UE8M0, got {h}")
    groups = x.float().view(n, h // FP8_GROUP, FP8_GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor: torch turns division by a Python scalar into a reciprocal multiply on GPU.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = ceil_pow2(scale)
    data = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data = data.view(n, h)
    if use_ue8m0:
        return data, pack_ue8m0(scale)
    return data, scale


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two float32 [N, G] -> int32 [N, G/4] of biased exponents, group g in byte g % 4."""
    n, g = scale.shape
    biased = (torch.frexp(scale)[1] - 1 + 127).to(torch.int32)  # 2**p has frexp exponent p + 1
    biased = biased.view(n, g // UE8M0_PACK, UE8M0_PACK)
    shifts = torch.arange(UE8M0_PACK, dtype=torch.int32, device=scale.device) * 8
    return (biased << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_ue8m0`: int32 [N, G/4] -> float32 scales [N, G]."""
    n, p = packed.shape
    shifts = torch.arange(UE8M0_PACK, dtype=torch.int32, device=packed.device) * 8
    biased = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return torch.ldexp(torch.ones(n, p * UE8M0_PACK, device=packed.device),
                       biased.view(n, p * UE8M0_PACK) - 127)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise fp8 `data` [..., H] with float32 [..., H/128] or UE8M0 int32 [..., H/512] scales."""
    h = data.shape[-1]
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales.reshape(-1, scales.shape[-1])).view(*scales.shape[:-1], -1)
    groups = data.float().view(*data.shape[:-1], h // FP8_GROUP, FP8_GROUP)
    return (groups * scales.unsqueeze(-1)).view(data.shape)
