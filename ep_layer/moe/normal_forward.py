"""FusedMoE's forward through normal (high-throughput) mode, for batches larger than the low-latency
buffer's T (prefill): route, DeepEP's layout and dispatch (each token once per rank that holds one of
its experts), this rank's experts on the rows they picked, each row's weighted sum over its local
experts, and the combine that adds the ranks' partial sums (docs/design.md section 4).

The expert inputs are packed into the masked layout [E_l, M, H] the expert kernels take, so both modes
run the same GEMMs on the same rows. The weighted sum runs in float32 in ascending k, as the low-latency
combine's does; here each rank's partial sum is rounded to bf16 before the combine adds them, so on
one rank the two modes agree bit for bit and on several they differ by those roundings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..quant import FP8_GROUP, per_token_cast_to_fp8

if TYPE_CHECKING:
    from .layer import FusedMoE


def normal_forward(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """bf16 [N, H] -> bf16 [N, H] for any N (all ranks call together); the layer's Buffer serves normal mode."""
    buffer = layer.buffer
    topk_idx, topk_weights = layer.route(x)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, layer.num_experts)
    send = per_token_cast_to_fp8(x) if layer.fp8 else x  # the low-latency dispatch's FP8 rule
    recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
        send, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    shared = layer.shared_expert(x)
    partial = local_expert_sums(layer, recv_x, recv_idx, recv_weights, max(counts, default=0))
    combined, _, _ = buffer.combine(partial, handle)
    return combined if shared is None else combined + shared


def local_expert_sums(layer: FusedMoE, recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                      recv_idx: torch.Tensor, recv_weights: torch.Tensor, most_rows: int) -> torch.Tensor:
    """bf16 [N, H]: for each received row, Σ_k recv_weights[i, k] · expert(recv_idx[i, k])(row i) over its
    local experts (ids ≥ 0), in float32, ascending k, rounded once; the rows are added to the layer's
    expert-load counters. `most_rows`: the most rows any local expert gets (the packed layout's M)."""
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    n, hidden = data.shape
    num_local = layer.num_local_experts
    # picks[i, l]: row i goes to local expert l; its place among expert l's rows is pos[i, l].
    picks = torch.zeros(n, num_local + 1, dtype=torch.bool, device=data.device)
    picks.scatter_(1, torch.where(recv_idx >= 0, recv_idx, num_local), True)
    picks = picks[:, :num_local]
    pos = picks.long().cumsum(dim=0) - 1
    rows, experts = picks.nonzero(as_tuple=True)
    recv_count = picks.sum(dim=0, dtype=torch.int32)
    layer.expert_load.add_(recv_count)  # the expert-load metrics count both modes' rows
    m = max(most_rows, 1)
    packed = data.new_zeros(num_local, m, hidden)
    packed[experts, pos[rows, experts]] = data[rows]
    inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = packed
    if scales is not None:
        packed_scales = scales.new_zeros(num_local, m, hidden // FP8_GROUP)
        packed_scales[experts, pos[rows, experts]] = scales[rows]
        inputs = (packed, packed_scales)
    y = layer.run_experts(inputs, recv_count)
    acc = torch.zeros(n, hidden, dtype=torch.float32, device=data.device)
    for k in range(recv_idx.shape[1]):
        local = recv_idx[:, k]
        i = (local >= 0).nonzero().squeeze(1)
        acc[i] += recv_weights[i, k, None] * y[local[i], pos[i, local[i]]].float()
    return acc.to(torch.bfloat16)
