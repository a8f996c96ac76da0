"""Device pointers that the functions of ep_layer._C take as one tuple: a low-latency dispatch's output set,
what its combine reads of that set, and every pointer of a normal-mode call. The tuple is in the order of the
names _C exports (DISPATCH_POINTERS, COMBINE_POINTERS, NORMAL_POINTERS), built here by field name;
ep_layer.native checks at load that both orders agree, so that no pointer lands in another's place. A
low-latency call's own tensors (x, topk_idx, ...) are not here: they change from call to call, and each
launch names them."""

from __future__ import annotations

from typing import NamedTuple


class DispatchPointers(NamedTuple):
    """A dispatch output set's memory (_C.prepare_dispatch)."""

    ticket: int  # int32 [1]: the sequence number the send half took, for the receive half
    recv_x: int  # 0 with rows in place
    recv_scales: int  # 0 without FP8
    recv_rows: int  # rows in place: int64 [E_l, R*T] byte offsets; else 0
    recv_count: int
    src_info: int
    layout_range: int
    combine_map: int


class CombinePointers(NamedTuple):
    """What a combine reads of its dispatch's output set (_C.prepare_combine)."""

    ticket: int  # the combine's own sequence number, beside the dispatch's
    recv_count: int
    combine_map: int


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
