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
    sync: every row is placed and gathered by index arithmetic; entries of other ranks' experts take no row
    and no part in the sum (ExpertKernels.weighted_rows)."""
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    n, hidden = data.shape
    num_local, topk = layer.num_local_experts, recv_idx.shape[1]
    device = data.device
    # Each entry's local expert, in (row, slot) order; num_local: an expert of another rank.
    expert = torch.where(recv_idx >= 0, recv_idx, num_local).flatten()
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))  # not bincount: on a GPU it reads the largest id
    recv_count = counts[:num_local].to(torch.int32)
    layer.expert_load.add_(recv_count)  # the expert-load metrics count both modes' rows
    if n == 0:
        return
    m = cdiv(max(most_rows, 1), SPECIALIZED_MULTIPLE) * SPECIALIZED_MULTIPLE
    # An entry's place among its expert's rows: a stable sort by expert keeps each expert's entries in row order
    # (a token's experts are distinct), one sort instead of a running count over [N, E_l].
    order = torch.sort(expert, stable=True).indices
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=device) - (counts.cumsum(0) - counts)[expert[order]]
    spare = num_local * m
    # Each entry's row of the flat packed layout [E_l * M, H]; the spare index for other ranks' experts.
    slot = torch.where(expert < num_local, expert * m + place, spare)
    # The token each packed row holds: one gather packs the rows (rows past an expert's count hold any row: the
    # GEMMs' rows are independent, and theirs are never read).
    source = torch.zeros(spare + 1, dtype=torch.int64, device=device)
    source[slot] = torch.arange(n * topk, device=device) // topk  # several entries reach only the spare
    source = source[:spare]
    inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = data.index_select(0, source).view(num_local, m, hidden)
    if scales is not None:
        inputs = (inputs, scales.index_select(0, source).view(num_local, m, hidden // FP8_GROUP))
    y = layer.run_experts(inputs, recv_count).reshape(spare, hidden)
    slot = torch.where(slot < spare, slot, -1).view(n, topk)
    layer.weighted_rows(y, slot, recv_weights, out)
