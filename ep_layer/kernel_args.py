"""The device pointers of one dispatch or combine call, as the launchers of ep_layer._C take them: a tuple
in the order of the names _C exports (DISPATCH_POINTERS, COMBINE_POINTERS), built here by field name.
ep_layer.native checks at load that both orders agree, so that no pointer lands in another's place."""

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
    recv_count: int
    combine_map: int
    topk_idx: int
    topk_weights: int
    out: int
    wait_stats: int  # 0 = not given
