"""The device pointers of one call (a low-latency dispatch or combine, a normal-mode call), as the launchers
of ep_layer._C take them: a tuple in the order of the names _C exports (DISPATCH_POINTERS, COMBINE_POINTERS,
NORMAL_POINTERS), built here by field name. ep_layer.native checks at load that both orders agree, so that
no pointer lands in another's place."""

from __future__ import annotations

from typing import NamedTuple


class DispatchPointers(NamedTuple):
    ticket: int  # int32 [1]: the sequence number the send half took, for the receive half
    x: int
    topk_idx: int
    recv_x: int  # 0 with rows in place
    recv_scales: int  # 0 without FP8
    recv_rows: int  # rows in place: int64 [E_l, R*T] byte offsets; else 0
    recv_count: int
    src_info: int
    layout_range: int
    combine_map: int
    recv_stats: int  # 0 = not given
    wait_stats: int  # 0 = not given


class CombinePointers(NamedTuple):
    ticket: int  # 0 when one kernel does both halves
    x: int
    x_row: int  # x's first row as a row of this rank's buffer, or -1 (a row index, not a pointer)
    stage_row: int  # with put ranks: the row of this rank's buffer that rows are put from, else -1
    recv_count: int
    combine_map: int
    topk_idx: int
    topk_weights: int
    out: int
    wait_stats: int  # 0 = not given
    # Single-batch overlap (backends.base.SendSignals; 0 = none): a pointer, then numbers.
    signals: int
    signal_rows: int
    signals_per_expert: int
    signal_threshold: int
    send_sms: int  # at most this many send blocks (0 = no cap)


class NormalPointers(NamedTuple):
    """One normal-mode call (csrc/normal.cuh: NormalCall, the same names); 0 where the call has none."""

    x: int  # the rows this rank stages: a dispatch's x (bf16 or e4m3), a combine's expert outputs
    scales: int
    topk_idx: int
    topk_weights: int
    in_rank: int  # bool [T, R]
    rows_to_rank: int  # int32 [R]
    tokens_per_expert: int  # int32 [E]
    meta: int  # int32 [2 + R + E/R]
    rank_prefix: int  # int32 [R, R]
    expected_prefix: int
    src_idx: int
    src_rank: int
    out_x: int
    out_scales: int
    out_topk_idx: int
    out_weights: int
    send_pos: int  # int32 [T, R]
    out: int
    bias0: int
    bias1: int
    combined_weights: int
