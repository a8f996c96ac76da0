"""Byte layout of the `cuda` backend's communication buffer, shared by Python and the kernels.

Each rank's buffer is mapped by every peer (CUDA IPC). It holds two halves, so that two results can
be outstanding (double buffering); each half holds:
- dispatch slots [source rank][token]: a header (arrival flag: sequence number and number of entries;
  then for each local expert it goes to: its top-k positions and its row offset) followed by the
  token's payload (bf16 row, or fp8 row plus scales);
- per-source expert counts [source rank][local expert], each tagged with the sequence number (its own
  arrival flag), from which the receiver places the rows;
- combine slots [token][top-k position]: one bf16 expert output each, plus an 8-byte arrival flag
  each (sequence number, and for a rank's own experts the row to read in place instead of data).
A token is written once per destination rank and expanded to its experts' rows by the receiver (or,
with rows in place, read from its slot by the expert GEMM: the slot's payload starts on a 128-byte line).
After the halves come two send areas, one per half: dispatch slots [destination rank][token] that a token's
header and payload are assembled in for the peers reached by NVSHMEM puts (the put's source must lie on
the symmetric heap, and each destination's header differs); the load/store transports leave them unused.
Then come two zero-copy combine buffers, bf16 [E_l, R*T, H] each, one per outstanding
dispatch (Buffer.get_next_low_latency_combine_buffer): expert outputs written there are combined
without a copy into the slots when the ranks share a GPU (the receivers read them where they are).
"""

from __future__ import annotations

from typing import NamedTuple

# The kernels' copies of MAX_TOPK, MAX_RANKS, MAX_EXPERTS, DISPATCH_HEADER_BYTES and CONTROL_BYTES
# (csrc/ll_common.cuh) are checked against these when ep_layer._C loads (ep_layer.native).
MAX_TOPK = 16
MAX_RANKS = 8  # ranks of one node that map each other's buffers
MAX_EXPERTS = 1024
# flag, pad + (expert | k mask, row offset) per entry, padded to 128-byte lines: payloads start on a line
DISPATCH_HEADER_BYTES = 256
COUNT_BYTES = 8  # (sender's tokens << 48) | (count << 32) | sequence number
COMBINE_FLAG_BYTES = 8
CONTROL_BYTES = 4096  # sequence counters, peers' arrival words, the error record, call timestamps
# Normal mode's buffer (csrc/normal.cuh): a control block, then two staging halves, each a header and rows.
NORMAL_CONTROL_BYTES = 4096
STAGE_HEADER_BYTES = 8192
ALIGN = 128


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def dispatch_slot_bytes(hidden: int) -> int:
    """Header plus the larger payload: a bf16 row (2H) beats fp8 data with float32 scales (H + H/32)."""
    return _align(DISPATCH_HEADER_BYTES + 2 * hidden)


def half_bytes(max_tokens: int, hidden: int, num_ranks: int) -> tuple[int, int, int, int]:
    """(dispatch slots, combine slots, combine flags, expert counts) bytes in one half of the buffer."""
    dispatch = _align(num_ranks * max_tokens * dispatch_slot_bytes(hidden))
    combine = _align(max_tokens * MAX_TOPK * 2 * hidden)
    flags = _align(max_tokens * MAX_TOPK * COMBINE_FLAG_BYTES)
    counts = _align(MAX_EXPERTS * COUNT_BYTES)  # [R][E_l] tagged counts: E at most
    return dispatch, combine, flags, counts


def send_area_bytes(max_tokens: int, hidden: int, num_ranks: int) -> int:
    """Bytes of one half's send area: a dispatch slot per destination rank and token."""
    return _align(num_ranks * max_tokens * dispatch_slot_bytes(hidden))


class BufferOffsets(NamedTuple):
    """The byte offsets the kernels address the buffer with (csrc/ll_common.cuh: BufferOffsets, the same
    fields); the dispatch slots, combine slots, combine flags and expert counts are offsets inside a half,
    `send` is where half 0's send area starts (half 1's follows it)."""

    control: int  # = CONTROL_BYTES: where half 0 starts
    half: int  # bytes of one half
    dispatch: int
    slot: int  # bytes of one dispatch slot
    combine: int
    flags: int
    counts: int
    send: int


def buffer_offsets(max_tokens: int, hidden: int, num_ranks: int) -> BufferOffsets:
    """The offsets in a buffer of `num_ranks` ranks that send up to `max_tokens` tokens of `hidden` channels."""
    dispatch, combine, flags, counts = half_bytes(max_tokens, hidden, num_ranks)
    half = dispatch + combine + flags + counts
    return BufferOffsets(control=CONTROL_BYTES, half=half, dispatch=0, slot=dispatch_slot_bytes(hidden),
                         combine=dispatch, flags=dispatch + combine, counts=dispatch + combine + flags,
                         send=CONTROL_BYTES + 2 * half)


def zero_copy_offset(max_tokens: int, hidden: int, num_ranks: int) -> int:
    """Where the two zero-copy combine buffers start: after the halves and the send areas, on a row boundary
    (2H bytes, a multiple of ALIGN for the backend's hidden sizes), so that the kernels can name a row by its
    index."""
    end = CONTROL_BYTES + 2 * (sum(half_bytes(max_tokens, hidden, num_ranks))
                               + send_area_bytes(max_tokens, hidden, num_ranks))
    row = 2 * hidden
    return (end + row - 1) // row * row


def zero_copy_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """Bytes of one zero-copy combine buffer, bf16 [E_l, R*T, H] (E_l * R = E)."""
    return num_experts * max_tokens * 2 * hidden


def allocated_low_latency_bytes(num_rdma_bytes: int) -> int:
    """What the cuda backend allocates for a low-latency buffer of `num_rdma_bytes`: that, or for a
    normal-mode-only Buffer (0) just the control block its error record and counters live in."""
    return num_rdma_bytes or CONTROL_BYTES


def low_latency_buffer_bytes(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes one rank's buffer needs."""
    return (zero_copy_offset(max_tokens, hidden, num_ranks)
            + 2 * zero_copy_bytes(max_tokens, hidden, num_experts))


# ---------------------------------------------------------------- normal mode (csrc/normal.cuh)
def row_stride(x_bytes: int, scale_bytes: int, idx_bytes: int, weight_bytes: int) -> int:
    """Bytes of one staged row: its columns at 16-byte aligned offsets (csrc/normal.cuh: row_stride)."""
    return sum(_align(b, 16) for b in (x_bytes, scale_bytes, idx_bytes, weight_bytes))


def stage_bytes(rows: int, stride: int, after_bytes: int) -> int:
    """Bytes of a staging half that `rows` rows use: the header, the rows, then `after_bytes` more per row
    (a dispatch's is_token_in_rank: R; a combine's top-k weights: 4K) (csrc/normal.cuh: after_rows)."""
    return _align(STAGE_HEADER_BYTES + rows * stride) + rows * after_bytes


def normal_buffer_bytes(half_bytes: int) -> int:
    """Bytes of a normal-mode buffer whose staging halves hold `half_bytes` each."""
    return NORMAL_CONTROL_BYTES + 2 * _align(half_bytes)


# Normal mode over NVSHMEM gets (csrc/normal.cuh): a landing area after the normal-mode buffer on the symmetric
# heap, where what a rank reads of a get rank's half lands (the peers' stage headers, a window of is_token_in_rank
# per peer, a piece per warp of the gather and reduce).
NORMAL_WARP_LANDING_BYTES = MAX_RANKS * 4096
NORMAL_LANDING_BYTES = MAX_RANKS * (STAGE_HEADER_BYTES + 32768) + 1024 * NORMAL_WARP_LANDING_BYTES


def normal_landing_offset(num_nvl_bytes: int) -> int:
    """Where the landing area starts in an NVSHMEM normal-mode allocation of a `num_nvl_bytes` buffer."""
    return _align(num_nvl_bytes)


def normal_combine_rows_offset(num_nvl_bytes: int) -> int:
    """Where a combine's rows start in a normal-mode buffer of `num_nvl_bytes`: after half 1's header (combines
    stage in half 1, csrc/normal.cuh)."""
    return NORMAL_CONTROL_BYTES + normal_half_bytes(num_nvl_bytes) + STAGE_HEADER_BYTES


def normal_half_bytes(num_nvl_bytes: int) -> int:
    """Bytes of each staging half of a normal-mode buffer of `num_nvl_bytes` (normal_buffer_bytes' inverse)."""
    return (num_nvl_bytes - NORMAL_CONTROL_BYTES) // 2 // ALIGN * ALIGN
