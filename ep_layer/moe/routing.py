"""DeepSeek-V3 `noaux_tc` routing (docs/design.md section 4): sigmoid scores, group-limited top-k with a
selection-only correction bias, weights from the unbiased scores.

Every step is a row-wise tensor op (no host sync, no data-dependent shape), so routing runs inside
CUDA graphs and gives a token the same experts and weights whatever batch it is part of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tiles import map_row_tiles

# Added to the sum of a token's top-k scores before dividing, as HF's DeepseekV3TopkRouter does:
# far below float32 resolution of any real sum, it only keeps a row whose scores all underflow finite.
NORM_EPS = 1e-20


@dataclass(frozen=True)
class RoutingConfig:
    """What `noaux_tc` routing needs, with DeepSeek-V3's names."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        e, g = self.num_experts, self.n_group
        if g <= 0 or e % g:
            raise ValueError(f"n_group: expected a positive divisor of num_experts={e}, got {g}")
        if not 0 < self.topk_group <= g:
            raise ValueError(f"topk_group: expected 1 to n_group={g}, got {self.topk_group}")
        if self.topk_group < g and e // g < 2:
            raise ValueError(f"n_group: group scores sum each group's top 2 experts, so groups need at "
                             f"least 2 experts; got {e // g} (num_experts={e}, n_group={g})")
        selectable = self.topk_group * (e // g)
        if not 0 < self.top_k <= selectable:
            raise ValueError(f"top_k: expected 1 to {selectable} (the experts of topk_group={self.topk_group} "
                             f"groups), got {self.top_k}")


def route(hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
          config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64 [N, K], topk_weights float32 [N, K]) for hidden_states [N, H] (any float dtype).

    Router logits are hidden_states times gate_weight [E, H], both in float32, as DeepSeek-V3 does;
    noaux_tc_route turns them into experts and weights (triton_routing.route does both on a GPU).
    """
    weight, bias = gate_weight.float(), e_score_correction_bias.float()

    def tile(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return noaux_tc_route(x.float() @ weight.t(), bias, config)

    return map_row_tiles(tile, hidden_states)


def noaux_tc_route(logits: torch.Tensor, e_score_correction_bias: torch.Tensor,
                   config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts and weights per token from float32 router logits [N, E].

    Returns (topk_idx int64 [N, K], topk_weights float32 [N, K]), experts in descending biased score.
    """
    num_tokens, e = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + e_score_correction_bias.float()  # the bias steers selection only
    if config.topk_group < config.n_group:
        groups = choice.view(num_tokens, config.n_group, e // config.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(config.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        # -inf, not 0: biased scores can be negative, and a dropped group must never win.
        choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, e)
    topk_idx = choice.topk(config.top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return topk_idx, weights * config.routed_scaling_factor
