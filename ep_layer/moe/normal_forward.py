"""FusedMoE's forward through normal (high-throughput) mode, for batches larger than the low-latency
buffer's T (prefill): route, DeepEP's layout and dispatch (each token once per rank that holds one of
its experts), this rank's experts on the rows they picked, each row's weighted sum over its local
experts, and the combine that adds the ranks' partial sums (docs/design.md section 4). The partial sums
are written where the combine reads them (Buffer.get_next_combine_buffer), so the combine copies nothing.

The expert inputs are packed into the masked layout [E_l, M, H] the expert kernels take, so both modes
run the same GEMMs on the same rows. The weighted sum runs in float32 in ascending k, as the low-latency
combine's does; here each rank's partial sum is rounded to bf16 before the combine adds them, so on
one rank the two modes agree bit for bit and on several they differ by those roundings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels.launch import SPECIALIZED_MULTIPLE, cdiv
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
    partial = buffer.get_next_combine_buffer(handle, x.shape[1])
    local_expert_sums(layer, recv_x, recv_idx, recv_weights, max(counts, default=0), partial)
    combined, _, _ = buffer.combine(partial, handle)
    return combined if shared is None else combined + shared


def local_expert_sums(layer: FusedMoE, recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                      recv_idx: torch.Tensor, recv_weights: torch.Tensor, most_rows: int, out: torch.Tensor) -> None:
    """Writes bf16 `out` [N, H]: for each received row, Σ_k recv_weights[i, k] · expert(recv_idx[i, k])(row i) over its
    local experts (ids ≥ 0), in float32, ascending k, rounded once; the rows are added to the layer's
    expert-load counters. `most_rows`: the most rows any local expert gets (the packed layout's M, rounded up to
    a multiple of SPECIALIZED_MULTIPLE: Triton compiles the expert GEMM per class of the strides M sets, so a busiest
    count of another class than warm-up's would compile on a request's time). No host
    sync: every row is placed and gathered by index arithmetic, slots of other ranks' experts going to a
    spare row and masked out of the sum."""
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    n, hidden = data.shape
    num_local = layer.num_local_experts
    # picks[i, l]: row i goes to local expert l; its place among expert l's rows is pos[i, l].
    picks = torch.zeros(n, num_local + 1, dtype=torch.bool, device=data.device)
    picks.scatter_(1, torch.where(recv_idx >= 0, recv_idx, num_local), True)
    picks = picks[:, :num_local]
    pos = picks.long().cumsum(dim=0) - 1
    recv_count = picks.sum(dim=0, dtype=torch.int32)
    layer.expert_load.add_(recv_count)  # the expert-load metrics count both modes' rows
    m = cdiv(max(most_rows, 1), SPECIALIZED_MULTIPLE) * SPECIALIZED_MULTIPLE
    local = recv_idx >= 0  # [N, K]
    expert = recv_idx.clamp(min=0)
    # Each (row, slot)'s row of the flat layout [E_l * M (+ a spare row), H].
    slot = torch.where(local, expert * m + pos.gather(1, expert), num_local * m)
    packed = data.new_zeros(num_local * m + 1, hidden)
    packed_scales = None if scales is None else scales.new_zeros(num_local * m + 1, hidden // FP8_GROUP)
    for k in range(recv_idx.shape[1]):  # a token's experts are distinct: only the spare row is written twice
        packed[slot[:, k]] = data
        if packed_scales is not None:
            packed_scales[slot[:, k]] = scales
    inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = packed[:-1].view(num_local, m, hidden)
    if packed_scales is not None:
        inputs = (inputs, packed_scales[:-1].view(num_local, m, hidden // FP8_GROUP))
    y = layer.run_experts(inputs, recv_count).reshape(num_local * m, hidden)
    acc = torch.zeros(n, hidden, dtype=torch.float32, device=data.device)
    for k in range(recv_idx.shape[1]):
        here = local[:, k, None]
        term = recv_weights[:, k, None] * y[torch.where(local[:, k], slot[:, k], 0)].float()
        acc = torch.where(here, acc + term, acc)
    out.copy_(acc)
