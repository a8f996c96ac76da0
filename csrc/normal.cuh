// Normal (high-throughput) mode: DeepEP's dispatch and combine for batches of any size among the ranks
// of one node (docs/design.md section 2, "Normal (high-throughput) mode"), over a second buffer per rank
// (num_nvl_bytes) that every peer maps through CUDA IPC.
//
// Each call is pulled, not pushed: a rank stages its rows once in its own buffer (stage kernel), tells
// every peer and waits for theirs (exchange kernel), and then copies the rows meant for it out of the
// peers' buffers (scan + gather for a dispatch, reduce for a combine). The buffer holds two staging
// halves: dispatches stage in half 0, combines in half 1, so the host knows where a combine's rows go
// and a caller can write them there itself (a zero-copy combine). The last block of a reader's gather
// or reduce tells the writer that its reads of that half are done (released); a stage waits for every
// reader's release of the half's previous call before it writes, which is at once in the usual
// dispatch, combine, dispatch order. No wait depends on a later call, so any order of calls is safe.
// A peer without a load/store path (another node, or every rank with EP_LAYER_NVSHMEM_FORCE_PUTS=1; ep_layer._C_nvshmem
// only) is read with NVSHMEM gets instead, into this rank's landing area (a get's destination must lie on the
// symmetric heap): the exchange fetches its stage header, the scan its is_token_in_rank a window at a time, and
// each warp of a gather or reduce its rows a piece at a time; its flags are set with NVSHMEM signals.
// Byte offsets have a Python twin in ep_layer/layout.py (stage_bytes, normal_combine_rows_offset, the landing area).
#pragma once

#include <cstddef>

#include "ll_common.cuh"

namespace ep {

constexpr int kNormalControlBytes = 4096;  // the NormalControl block, then the two staging halves
constexpr int kStageHeaderBytes = 8192;    // the StageHeader at the start of a half; the rows follow

enum NormalOp : int { kNormalDispatch = 0, kNormalCachedDispatch = 1, kNormalCombine = 2 };
// ErrorRecord::op of normal-mode failures (the low-latency Ops are 0 and 1).
constexpr int kNormalDispatchErrorOp = 2;
constexpr int kNormalCombineErrorOp = 3;
// ErrorCodes of normal mode only (after those of ll_common.cuh).
constexpr int kBadHandle = 4;    // a cached dispatch's handle does not match the ranks' counts
constexpr int kTooManyRows = 5;  // more rows arrive than num_worst_tokens; detail = the rows

// First kNormalControlBytes of a rank's normal-mode buffer.
struct NormalControl {
  unsigned long long launches[2];  // [0]: the launch counter of the normal calls (take_ticket's scheme)
  ErrorRecord error;               // at Control::error's offset: read_error / clear_error serve both buffers
  // ready[seq & 1][src]: the sequence number of the last call whose rows rank src has staged.
  unsigned long long ready[2][kMaxRanks];
  // released[half][reader]: the last call whose reads of this rank's half `reader` has finished.
  unsigned long long released[2][kMaxRanks];
  unsigned long long half_seq[2];  // the last call this rank staged in each half (the exchange writes it)
  unsigned finished[2];            // blocks of this rank's gather / reduce done, so that the last releases
};
static_assert(offsetof(NormalControl, error) == offsetof(Control, error), "one error record layout");
static_assert(sizeof(NormalControl) <= kNormalControlBytes, "NormalControl must fit kNormalControlBytes");

// At the start of a staging half: what the readers of the half need to find and check its rows.
// Rows start at kStageHeaderBytes, each the staged columns at 16-byte aligned offsets (row_stride);
// after the rows (after_rows) come a dispatch's is_token_in_rank [rows, R] or a combine's top-k
// weights [rows, K], so a combine's rows are one plain [rows, H] bf16 tensor.
struct StageHeader {
  unsigned long long op;  // NormalOp
  unsigned long long x_bytes, scale_bytes, idx_bytes, weight_bytes;  // each row's columns
  unsigned long long num_experts;  // E of a dispatch; 0 otherwise
  unsigned long long num_rows;     // rows staged: the tokens of a dispatch, the received rows of a combine
  unsigned long long seq;          // the call's sequence number: a peer reading a stale header sees another
  int rows_to_rank[kMaxRanks];         // dispatch: tokens going to each rank (is_token_in_rank's column sums)
  int tokens_per_expert[kMaxExperts];  // non-cached dispatch: num_tokens_per_expert
};
static_assert(sizeof(StageHeader) <= kStageHeaderBytes, "StageHeader must fit kStageHeaderBytes");

// The landing area (after the normal-mode buffer, on the NVSHMEM heap): the get ranks' stage headers [R], then a
// window of is_token_in_rank per rank [R], then a piece per warp of a gather or reduce [kLandingWarps].
constexpr int kLandingWarps = 1024;                         // warps of a gather or reduce with get ranks at most
constexpr int kPieceBytes = 4096;                           // a reduce gets each rank's row in pieces of this size
constexpr int kWarpLandingBytes = kMaxRanks * kPieceBytes;  // a warp's: a gather's piece of a row, a reduce's pieces
constexpr int kScanLandingBytes = 32768;                    // per rank: is_token_in_rank rows of R bytes
constexpr long long kLandingWarpsAt = static_cast<long long>(kMaxRanks) * (kStageHeaderBytes + kScanLandingBytes);
constexpr long long kLandingBytes = kLandingWarpsAt + static_cast<long long>(kLandingWarps) * kWarpLandingBytes;

__host__ __device__ constexpr long long align_up(long long n, long long to) { return (n + to - 1) / to * to; }

__host__ __device__ inline long long row_stride(long long x, long long scale, long long idx, long long weight) {
  return align_up(x, 16) + align_up(scale, 16) + align_up(idx, 16) + align_up(weight, 16);
}

__host__ __device__ inline long long after_rows(long long rows, long long stride) {
  return align_up(kStageHeaderBytes + rows * stride, 128);
}

// What stays the same across a rank's normal calls.
struct NormalCommon {
  int rank, num_ranks;
  int system_scope;                 // peers on other GPUs: order at system scope
  long long peer_bases[kMaxRanks];  // each rank's normal-mode buffer, mapped here
  unsigned char* local_base;        // this rank's
  long long half_bytes;             // bytes of one staging half
  volatile int* host_error;         // host-mapped flag: set when an error is recorded
  unsigned long long timeout_ns;
  unsigned* ticket;                 // the sequence number of the call in flight (stage writes it)
  unsigned get_ranks;               // ranks read with NVSHMEM gets (bit r; ep_layer._C_nvshmem only)
  unsigned char* landing;           // this rank's landing area (kLandingBytes), or null without get ranks
};

// One call; fields a kernel does not use are 0. Row counts: num_rows staged here, out_rows received.
struct NormalCall {
  int op;  // NormalOp
  int num_rows;
  int x_bytes, scale_bytes, num_topk, has_idx, has_weights;
  int num_experts;                 // E (dispatch)
  int rows_in_place;               // combine: x already is this rank's half 1 (a zero-copy combine)
  const void* x;                   // [num_rows, x_bytes]: bf16 or e4m3 rows (dispatch), expert outputs (combine)
  const void* scales;              // [num_rows, scale_bytes] or null
  const long long* topk_idx;       // [num_rows, K] or null
  const float* topk_weights;       // [num_rows, K] or null
  const bool* in_rank;             // [T, R]: is_token_in_rank of this rank's tokens
  const int* rows_to_rank;         // [R]: is_token_in_rank's column sums (dispatch)
  const int* tokens_per_expert;    // [E] or null
  int* meta;                       // [2 + R + E/R]: ok, rows received, rows from each source, per local expert
  int* rank_prefix;                // [R, R]: written by a dispatch, read by a combine
  const int* expected_prefix;      // cached dispatch: the handle's rank_prefix_matrix
  int* src_idx;                    // [out_rows]: written by a dispatch's scan, read by gather
  int* src_rank;                   // [out_rows]; a combine's: the handle's (its padding rows are not staged)
  int out_rows;                    // rows of the outputs (the rows received, or num_worst_tokens)
  void* out_x;                     // [out_rows, x_bytes]
  void* out_scales;                // [out_rows, scale_bytes]
  long long* out_topk_idx;         // [out_rows, K]
  float* out_weights;              // [out_rows, K]
  int num_tokens;                  // combine: T, this rank's tokens
  const int* send_pos;             // combine: [T, R], each token's place among the rows sent to each rank
  __nv_bfloat16* out;              // combine: [T, H]
  const __nv_bfloat16* bias0;      // combine: [T, H] or null
  const __nv_bfloat16* bias1;
  float* combined_weights;         // combine: [T, K] or null
};

// Loads the kernels now: under CUDA's lazy loading a first launch may wait for the kernels running on
// the device, and one rank's exchange kernel waits for a peer whose kernels the host launches next.
cudaError_t normal_load_kernels();
void normal_stage(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream);
// Waits until every peer has released this rank's half 1, for a caller about to write a combine's rows there.
void normal_wait_combine_half(const NormalCommon& c, cudaStream_t stream);
void normal_exchange(const NormalCommon& c, const NormalCall& call, cudaStream_t stream);
void normal_scan(const NormalCommon& c, const NormalCall& call, cudaStream_t stream);
void normal_gather(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream);
void normal_reduce(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream);

}  // namespace ep
