"""RoPE with YaRN scaling as DeepSeek-V3 checkpoints use it, op for op as transformers 5 computes it
(modeling_rope_utils._compute_yarn_parameters, DeepseekV3RotaryEmbedding, yarn_apply_mscale and
apply_rotary_pos_emb_interleave), so that the float32 results agree bit for bit.

YaRN changes three things: the inverse frequencies (interpolated below the correction range,
extrapolated above it, ramped between), cos/sin scaled by `attention_factor`, and the softmax scale
multiplied by mscale(factor, mscale_all_dim)**2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..model_config import ModelConfig, RopeScaling
from . import rotary_triton


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(dim: int, base: float, yarn: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """float32 [dim / 2] inverse frequencies and the factor cos/sin are multiplied by."""
    if yarn is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, yarn.mscale)
                                     / yarn_get_mscale(factor, yarn.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN (when mscale_all_dim is set)."""
    scale = config.qk_head_dim ** (-0.5)
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        mscale = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin per position (computed on the fly: no table, any position) and their application."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inv_freq_and_attention_factor(
            config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.interleave = config.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, rope_dim / 2] (one angle per rotated pair) for int64 positions [N]."""
        freqs = positions[:, None].float() * self.inv_freq
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
        """RoPE of x [N, ..., rope_dim] with cos/sin [N, rope_dim / 2].

        interleave (DeepSeek): pairs (x0, x1), (x2, x3), ...; the result is laid out de-interleaved,
        [rotated evens | rotated odds], exactly as transformers returns it. q and k get the same
        permutation, so q.k is unchanged; the KV cache holds k_pe in this layout.
        Otherwise: pairs (x_i, x_{i + d/2}) (rotate_half).
        """
        if x.is_cuda and x.dtype == cos.dtype == sin.dtype and x.dim() in (2, 3) and rotary_triton.available():
            return rotary_triton.rotate(x, cos, sin, interleave)  # the same bits in one launch
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
