"""DeepEP's `get_dispatch_layout`: how many tokens go to each rank and each expert, from the top-k ids
alone. The same for every backend: a few tensor operations on the ids' device, no host sync."""

from __future__ import annotations

import torch


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]) of
    int64 ids `topk_idx` [T, K]: a token counts once for each rank that holds any of its experts, and once
    per top-k entry for each expert. Ids of -1 select nothing; ids outside [0, E) are left out here (the
    dispatch that is given them rejects them)."""
    num_tokens = topk_idx.shape[0]
    num_local = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    # Out-of-range entries go to a last column that is dropped.
    rank_of = torch.where(valid, topk_idx // num_local, num_ranks)
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, rank_of, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, torch.where(valid, topk_idx, num_experts).flatten(),
                            torch.ones(topk_idx.numel(), dtype=torch.int32, device=topk_idx.device))
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, per_expert[:num_experts], is_token_in_rank
