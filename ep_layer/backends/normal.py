"""What a backend's normal (high-throughput) mode takes and returns: DeepEP's `dispatch` / `combine`
after the Buffer has checked every argument (docs/design.md section 2, normal mode)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class NormalHandle(NamedTuple):
    """DeepEP's intranode handle, with our fields; callers treat it as opaque and pass it back.

    Row i of a dispatch's outputs came from rank `recv_src_rank[i]`, token `recv_src_idx[i]`; the rows
    are ordered by source rank, then token. With `num_worst_tokens` the outputs have that many rows and
    the rows past the ones received name source -1."""

    rank_prefix_matrix: torch.Tensor  # int32 [R, R]: [s, d] = rows that ranks 0..s send rank d
    recv_src_idx: torch.Tensor  # int32 [N]: the source token of each received row
    recv_src_rank: torch.Tensor  # int32 [N]: the source rank of each received row
    is_token_in_rank: torch.Tensor  # bool [T, R]: the ranks this rank sent each of its tokens to
    num_topk: int  # K of the dispatch's top-k (0 without topk_idx)


class NormalDispatchArgs(NamedTuple):
    """One checked dispatch. `columns` are the per-token tensors that travel: the bf16 rows, or the e4m3
    rows and their scales (float32 or packed UE8M0 int32, [T] or [T, S])."""

    columns: tuple[torch.Tensor, ...]
    is_token_in_rank: torch.Tensor  # bool [T, R]
    num_tokens_per_rank: torch.Tensor | None  # int32 [R]; None for a cached dispatch
    num_tokens_per_expert: torch.Tensor | None  # int32 [E]; None for a cached dispatch
    topk_idx: torch.Tensor | None  # int64 [T, K]
    topk_weights: torch.Tensor | None  # float32 [T, K]
    num_experts: int  # E; 0 for a cached dispatch (its handle fixes the layout)
    num_worst_tokens: int  # 0: outputs sized to the rows received
    cached: NormalHandle | None  # the handle of an earlier dispatch whose layout this one re-sends
    num_sms: int  # the SMs the kernels may use (Config.num_sms; DeepEP's budget)


class NormalDispatchResult(NamedTuple):
    columns: tuple[torch.Tensor, ...]  # the received rows of each column: [N, ...]
    topk_idx: torch.Tensor | None  # int64 [N, K]: local expert ids, -1 for experts elsewhere
    topk_weights: torch.Tensor | None  # float32 [N, K]: 0 where the id is -1
    num_recv_tokens_per_expert: list[int] | None  # unaligned; None with num_worst_tokens or cached
    handle: NormalHandle


class NormalCombineArgs(NamedTuple):
    x: torch.Tensor  # bf16 [N, H]: one row per received row of the dispatch
    topk_weights: torch.Tensor | None  # float32 [N, K]
    bias: tuple[torch.Tensor, ...]  # 0, 1 or 2 bf16 [T, H], added to the sums
    handle: NormalHandle
    num_sms: int  # the SMs the kernels may use (Config.num_sms; DeepEP's budget)
