"""DeepSeek-V3's `noaux_tc` expert selection in one Triton kernel (GPU only): the same rule as
routing.noaux_tc_route, which takes about a dozen PyTorch kernels (sigmoid, two top-k sorts, scatter,
gather, sums) and on an H200 ~60 µs per call at 64 tokens, most of it launches and tiny sorts.

One program per token holds the token's E scores in registers as [groups, experts per group], then picks
the kept groups and the top-k experts by repeated arg-max (ties go to the lower expert index). Sigmoid
and the divisions are IEEE (libdevice exp, div_rn), as PyTorch's CUDA kernels compute them; only the
order of the final k-term sum can differ from torch's reduction, so weights agree to float32 rounding.
A NaN score never wins (torch.topk would take it first): every expert index it writes is in range.

Importing this module needs neither Triton nor a GPU (triton_experts.available() says whether it runs).
"""

from __future__ import annotations

import torch

from .routing import NORM_EPS, RoutingConfig

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # no Triton in this install: routing.noaux_tc_route still works
    triton = None

if triton is not None:

    @triton.jit
    def _noaux_tc_kernel(logits_ptr, bias_ptr, idx_ptr, weights_ptr, routed_scaling_factor, norm_eps,
                         N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         TOP_K: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                         TOPK_PAD: tl.constexpr, NORMALIZE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.arange(0, GROUPS_PAD)
        column = tl.arange(0, GROUP_PAD)[None, :]
        expert = group[:, None] * GROUP_SIZE + column
        valid = (group[:, None] < N_GROUP) & (column < GROUP_SIZE)
        logits = tl.load(logits_ptr + row * (N_GROUP * GROUP_SIZE) + expert, mask=valid, other=0.0)
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
    num_tokens, num_experts = logits.shape
    logits = logits.float().contiguous()
    bias = e_score_correction_bias.float().contiguous()
    topk_idx = torch.empty(num_tokens, config.top_k, dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return topk_idx, topk_weights
    group_size = num_experts // config.n_group
    _noaux_tc_kernel[(num_tokens,)](
        logits, bias, topk_idx, topk_weights, config.routed_scaling_factor, NORM_EPS,
        N_GROUP=config.n_group, GROUP_SIZE=group_size, TOPK_GROUP=config.topk_group, TOP_K=config.top_k,
        GROUPS_PAD=triton.next_power_of_2(config.n_group), GROUP_PAD=triton.next_power_of_2(group_size),
        TOPK_PAD=triton.next_power_of_2(config.top_k), NORMALIZE=config.norm_topk_prob, num_warps=1)
    return topk_idx, topk_weights
