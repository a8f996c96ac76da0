"""DeepSeek-V3's routing on a GPU: the float32 router logits, then the `noaux_tc` expert selection in one
Triton kernel. The selection is routing.noaux_tc_route's rule, which takes about a dozen PyTorch kernels
(sigmoid, two top-k sorts, scatter, gather, sums), most of their time launches and tiny sorts
(benchmarks/RESULTS.md, bench_moe.py).

The logits come in float32 parts over slices of the hidden channels, which the selection adds in order
(deterministic). For up to 16 tokens a split GEMV in Triton computes them: each program multiplies 4
experts' weights by the tokens over 512 channels (products and a fixed tree of adds in float32), several
times faster there than cuBLAS's float32 GEMM. Past 16 tokens cuBLAS's batched float32 GEMM
computes one part per 256 channels: its single GEMM has only a few output tiles, each streaming all
7168 channels (benchmarks/RESULTS.md, bench_moe.py).

One program per token holds the token's E scores in registers as [groups, experts per group], then picks
the kept groups and the top-k experts by repeated arg-max (ties go to the lower expert index). Sigmoid
and the divisions are IEEE (libdevice exp, div_rn), as PyTorch's CUDA kernels compute them; only the
order of the final k-term sum can differ from torch's reduction, so weights agree to float32 rounding.
A NaN score never wins (torch.topk would take it first): every expert index it writes is in range.

Importing this module needs neither Triton nor a GPU (ep_layer.kernels.triton_support.available() says
whether it runs).
"""

from __future__ import annotations

import torch

from ..kernels.launch import Launcher, cdiv, next_power_of_2
from ..kernels.triton_support import tl, triton
from .routing import NORM_EPS, RoutingConfig

GEMV_MAX_TOKENS = 16  # the split GEMV computes the logits of at most this many tokens
GEMV_BLOCK_E = 4  # experts per GEMV program
GEMV_BLOCK_H = 512  # channels per GEMV program (one part)
GEMM_PART_CHANNELS = 256  # past GEMV_MAX_TOKENS: channels per part of cuBLAS's batched GEMM

if triton is not None:
    from triton.language.extra.cuda import libdevice

    @Launcher
    @triton.jit
    def _router_gemv_kernel(x_ptr, w_ptr, part_ptr, N, E, H, stride_x, stride_w,
                            BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        """part[s] [N, E] = x[:, d] . w[:, d]^T over the s-th BLOCK_H channels d: x in any float dtype
        (converted in registers), w float32 [E, H]; float32 products summed by a fixed tree."""
        experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_N)
        channels = split * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok, expert_ok, channel_ok = rows < N, experts < E, channels < H
        x = tl.load(x_ptr + rows[:, None] * stride_x + channels[None, :], mask=row_ok[:, None] & channel_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + experts[:, None] * stride_w + channels[None, :],
                    mask=expert_ok[:, None] & channel_ok[None, :], other=0.0)
        part = tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        tl.store(part_ptr + (split * N + rows[:, None]) * E + experts[None, :], part,
                 mask=row_ok[:, None] & expert_ok[None, :])

    @Launcher
    @triton.jit
    def _noaux_tc_kernel(logits_ptr, bias_ptr, idx_ptr, weights_ptr, routed_scaling_factor, norm_eps, part_stride,
                         PARTS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPS_PAD: tl.constexpr,
                         GROUP_PAD: tl.constexpr, TOPK_PAD: tl.constexpr, NORMALIZE: tl.constexpr):
        """One token's experts and weights; its logits are the sum of PARTS parts part_stride apart."""
        row = tl.program_id(0).to(tl.int64)
        group = tl.arange(0, GROUPS_PAD)
        column = tl.arange(0, GROUP_PAD)[None, :]
        expert = group[:, None] * GROUP_SIZE + column
        valid = (group[:, None] < N_GROUP) & (column < GROUP_SIZE)
        at = logits_ptr + row * (N_GROUP * GROUP_SIZE) + expert
        logits = tl.load(at, mask=valid, other=0.0)
        for part in tl.static_range(1, PARTS):  # in order: deterministic
            logits += tl.load(at + part * part_stride, mask=valid, other=0.0)
        scores = tl.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + libdevice.exp(-logits))
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0)
        choice = scores + bias
        choice = tl.where(valid & (choice == choice), choice, float("-inf"))  # padding and NaN never win
        expert = tl.where(valid, expert, N_GROUP * GROUP_SIZE)  # padding would alias the next group's experts
        if TOPK_GROUP < N_GROUP:
            # A group's score is the sum of its two best biased scores (a tie counts twice, as torch.topk).
            best = tl.max(choice, axis=1)
            first = tl.argmax(choice, axis=1)
            second = tl.max(tl.where(column == first[:, None], float("-inf"), choice), axis=1)
            group_score = tl.where(group < N_GROUP, best + second, float("-inf"))
            kept = group < 0
            for _ in tl.static_range(TOPK_GROUP):
                pick = tl.argmax(group_score, axis=0)
                kept = kept | (group == pick)
                group_score = tl.where(group == pick, float("-inf"), group_score)
            choice = tl.where(kept[:, None], choice, float("-inf"))
        slot = tl.arange(0, TOPK_PAD)
        chosen = tl.zeros([TOPK_PAD], dtype=tl.int64)
        weights = tl.zeros([TOPK_PAD], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            top = tl.max(tl.max(choice, axis=1), axis=0)
            pick = tl.min(tl.min(tl.where(choice == top, expert, N_GROUP * GROUP_SIZE), axis=1), axis=0)
            weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0)
            chosen = tl.where(slot == k, pick.to(tl.int64), chosen)
            weights = tl.where(slot == k, weight, weights)
            choice = tl.where(expert == pick, float("-inf"), choice)
        if NORMALIZE:
            total = tl.sum(weights, axis=0) + norm_eps
            weights = tl.div_rn(weights, tl.zeros_like(weights) + total)
        in_row = slot < TOP_K
        tl.store(idx_ptr + row * TOP_K + slot, chosen, mask=in_row)
        tl.store(weights_ptr + row * TOP_K + slot, weights * routed_scaling_factor, mask=in_row)


def noaux_tc_route(logits: torch.Tensor, e_score_correction_bias: torch.Tensor,
                   config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.noaux_tc_route in one kernel launch, for CUDA float32 logits [N, E]."""
    if logits.dim() != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(f"logits: expected [N, {config.num_experts}] (num_experts columns), got {list(logits.shape)}")
    return _select(logits.float().contiguous()[None], e_score_correction_bias, config)


def route(hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
          config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.route for CUDA tensors: the logits' parts (the split GEMV for up to GEMV_MAX_TOKENS tokens,
    else cuBLAS's batched GEMM), then the selection kernel."""
    n, h = hidden_states.shape
    e = config.num_experts
    if tuple(gate_weight.shape) != (e, h):
        raise ValueError(f"gate_weight: expected [{e}, {h}] (num_experts x hidden), got {list(gate_weight.shape)}")
    weight = gate_weight.float().contiguous()
    if n > GEMV_MAX_TOKENS:
        num_parts = h // GEMM_PART_CHANNELS if h % GEMM_PART_CHANNELS == 0 else 1
        x = hidden_states.float().reshape(n, num_parts, h // num_parts).transpose(0, 1)
        parts = torch.bmm(x, weight.view(e, num_parts, h // num_parts).permute(1, 2, 0))  # [parts, n, e]
        return _select(parts, e_score_correction_bias, config)
    x = hidden_states.contiguous()
    parts = torch.empty(cdiv(h, GEMV_BLOCK_H), n, e, dtype=torch.float32, device=x.device)
    if n > 0:
        _router_gemv_kernel[(cdiv(e, GEMV_BLOCK_E), parts.shape[0])](
            x, weight, parts, n, e, h, x.stride(0), weight.stride(0), BLOCK_N=next_power_of_2(n),
            BLOCK_E=GEMV_BLOCK_E, BLOCK_H=GEMV_BLOCK_H, num_warps=2)
    return _select(parts, e_score_correction_bias, config)


def _select(parts: torch.Tensor, e_score_correction_bias: torch.Tensor,
            config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection kernel on the sum of float32 logit parts [P, N, E] (contiguous), added in order."""
    num_parts, num_tokens, num_experts = parts.shape
    bias = e_score_correction_bias.float().contiguous()
    topk_idx = torch.empty(num_tokens, config.top_k, dtype=torch.int64, device=parts.device)
    topk_weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=parts.device)
    if num_tokens == 0:
        return topk_idx, topk_weights
    group_size = num_experts // config.n_group
    _noaux_tc_kernel[(num_tokens,)](
        parts, bias, topk_idx, topk_weights, config.routed_scaling_factor, NORM_EPS, num_tokens * num_experts,
        PARTS=num_parts, N_GROUP=config.n_group, GROUP_SIZE=group_size, TOPK_GROUP=config.topk_group,
        TOP_K=config.top_k, GROUPS_PAD=next_power_of_2(config.n_group),
        GROUP_PAD=next_power_of_2(group_size), TOPK_PAD=next_power_of_2(config.top_k),
        NORMALIZE=config.norm_topk_prob, num_warps=1)
    return topk_idx, topk_weights
