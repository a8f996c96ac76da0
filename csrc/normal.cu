// Normal-mode kernels (normal.cuh): stage, exchange, scan, gather (dispatch) and reduce (combine).
#include <algorithm>

#include "normal.cuh"

namespace ep {
namespace {

constexpr int kWarps = 16;  // warps per block of the copy kernels: one row (or token) per warp at a time
constexpr int kScanThreads = 1024;

__device__ __forceinline__ NormalControl* control_of(long long base) {
  return reinterpret_cast<NormalControl*>(base);
}

// Dispatches stage in half 0, combines in half 1 (normal.cuh).
__device__ __forceinline__ int half_index(int op) { return op == kNormalCombine ? 1 : 0; }

__device__ __forceinline__ unsigned char* half_of(const NormalCommon& c, long long base, int op) {
  return reinterpret_cast<unsigned char*>(base) + kNormalControlBytes + half_index(op) * c.half_bytes;
}

// The ranks read with NVSHMEM gets (bits).
__device__ __forceinline__ unsigned get_mask(const NormalCommon& c) { return nvshmem_only(c.get_ranks); }

__device__ __forceinline__ bool by_get(const NormalCommon& c, int r) { return (get_mask(c) >> r) & 1u; }

// Sets the flag `*p` of rank r (a symmetric address for a get rank) to v, after everything this thread wrote or
// read before: a release store, or an NVSHMEM signal after a system fence.
__device__ __forceinline__ void set_flag(const NormalCommon& c, int r, unsigned long long* p, unsigned long long v) {
#ifdef EP_LAYER_NVSHMEM
  if (by_get(c, r)) {
    __threadfence_system();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(p), v, NVSHMEM_SIGNAL_SET, r);
    return;
  }
#endif
  st_release(c, p, v);
}

__device__ __forceinline__ unsigned char* landed_header(const NormalCommon& c, int r) {
  return c.landing + static_cast<long long>(r) * kStageHeaderBytes;
}

#ifdef EP_LAYER_NVSHMEM
__device__ __forceinline__ unsigned char* landed_in_rank(const NormalCommon& c, int r) {
  return c.landing + kMaxRanks * kStageHeaderBytes + static_cast<long long>(r) * kScanLandingBytes;
}

// The calling warp's piece of the landing area (the grid has at most kLandingWarps warps with get ranks).
__device__ __forceinline__ unsigned char* warp_landing(const NormalCommon& c) {
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  return c.landing + kLandingWarpsAt + static_cast<long long>(warp) * kWarpLandingBytes;
}
#endif

// Rank r's stage header of this call: where it lies, or the copy the exchange fetched from a get rank.
__device__ __forceinline__ const StageHeader* stage_header(const NormalCommon& c, int r, int op) {
  return reinterpret_cast<const StageHeader*>(by_get(c, r) ? landed_header(c, r) : half_of(c, c.peer_bases[r], op));
}

__device__ __forceinline__ int error_op(const NormalCall& call) {
  return call.op == kNormalCombine ? kNormalCombineErrorOp : kNormalDispatchErrorOp;
}

__device__ void record_normal_error(const NormalCommon& c, int op, int code, unsigned ranks, int detail = 0) {
  record_error(reinterpret_cast<NormalControl*>(c.local_base)->error, c.host_error, op, code, ranks, detail);
}

// Polls rank src's ready flag in this rank's control block until it reaches `seq`; false after the timeout.
__device__ bool wait_ready(const NormalCommon& c, const unsigned long long* flag, unsigned seq) {
  WaitClock clock;
  while (static_cast<unsigned>(ld_acquire(c, flag)) != seq)
    if (clock.expired(c.timeout_ns)) return false;
  return true;
}

__device__ __forceinline__ unsigned current_seq(const NormalCommon& c) {
  return *reinterpret_cast<volatile unsigned*>(c.ticket);
}

// Threads r < R of the block wait until rank r has released this rank's half h from the last call staged
// there; a rank that does not within the timeout is recorded as late (op's error) and no longer waited for.
__device__ void wait_released(const NormalCommon& c, int h, int op) {
  NormalControl* ctl = control_of(reinterpret_cast<long long>(c.local_base));
  const unsigned last = static_cast<unsigned>(*reinterpret_cast<volatile unsigned long long*>(&ctl->half_seq[h]));
  if (threadIdx.x < c.num_ranks) {
    const unsigned long long* flag = &ctl->released[h][threadIdx.x];
    const auto released = [&] { return static_cast<int>(static_cast<unsigned>(ld_acquire(c, flag)) - last) >= 0; };
    WaitClock clock;
    while (!released()) {
      if (clock.expired(c.timeout_ns)) {
        record_normal_error(c, op, kTimeout, 1u << threadIdx.x);
        break;
      }
    }
  }
  __syncthreads();
}

// Every thread of a reading kernel's block, at its end: the grid's last block tells every peer that this
// rank's reads of its half h for call seq are done.
__device__ void release_reads(const NormalCommon& c, int h, unsigned seq) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    NormalControl* ctl = control_of(reinterpret_cast<long long>(c.local_base));
    last = atomicAdd(&ctl->finished[h], 1u) == gridDim.x - 1;
    if (last) ctl->finished[h] = 0;
  }
  __syncthreads();
  if (last && threadIdx.x < c.num_ranks) {
    if (c.system_scope) __threadfence_system();
    set_flag(c, threadIdx.x, &control_of(c.peer_bases[threadIdx.x])->released[h][c.rank],
             static_cast<unsigned long long>(seq));
  }
}

// Copies `bytes` (a multiple of 4) from src to dst with the lanes of one warp: 16-byte vectors where both
// are 16-byte aligned, else 4-byte words.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    copy_vectors(static_cast<int4*>(dst), static_cast<const int4*>(src), bytes / 16, lane, 32);
    return;
  }
  auto* d = static_cast<int*>(dst);
  const auto* s = static_cast<const int*>(src);
  for (int i = lane; i < bytes / 4; i += 32) d[i] = __ldcg(s + i);
}

// ------------------------------------------------------------------------------------------------ stage
// Packs this rank's rows into its half for this call, once every reader has released the half: a
// dispatch's rows (all columns) and is_token_in_rank, or a combine's bf16 rows (unless they are in place)
// and top-k weights; block 0 writes the header and the call's sequence number for the kernels after it.
__global__ void __launch_bounds__(kWarps * 32) stage_kernel(NormalCommon c, NormalCall call) {
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = take_ticket(&reinterpret_cast<NormalControl*>(c.local_base)->launches[0]);
  const int h = half_index(call.op);
  wait_released(c, h, error_op(call));
  const unsigned seq = ticket;
  unsigned char* half = half_of(c, reinterpret_cast<long long>(c.local_base), call.op);
  const bool combine = call.op == kNormalCombine;
  const int idx_bytes = call.has_idx ? 8 * call.num_topk : 0;
  const int weight_bytes = call.has_weights ? 4 * call.num_topk : 0;
  const long long stride = combine ? row_stride(call.x_bytes, 0, 0, 0)
                                   : row_stride(call.x_bytes, call.scale_bytes, idx_bytes, weight_bytes);
  const int lane = threadIdx.x % 32;
  if (blockIdx.x == 0) {
    auto* hd = reinterpret_cast<StageHeader*>(half);
    if (threadIdx.x == 0) {
      *c.ticket = seq;
      hd->op = call.op;
      hd->x_bytes = call.x_bytes;
      hd->scale_bytes = call.scale_bytes;
      hd->idx_bytes = idx_bytes;
      hd->weight_bytes = weight_bytes;
      hd->num_experts = call.num_experts;
      hd->num_rows = call.num_rows;
      hd->seq = seq;
    }
    if (call.rows_to_rank != nullptr && threadIdx.x < c.num_ranks) hd->rows_to_rank[threadIdx.x] = call.rows_to_rank[threadIdx.x];
    if (call.tokens_per_expert != nullptr)
      for (int e = threadIdx.x; e < call.num_experts; e += blockDim.x) hd->tokens_per_expert[e] = call.tokens_per_expert[e];
  }
  unsigned char* after = half + after_rows(call.num_rows, stride);  // is_token_in_rank, or a combine's weights
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  const int warps = gridDim.x * kWarps;
  for (int t = warp; t < call.num_rows; t += warps) {
    if (call.src_rank != nullptr && call.src_rank[t] < 0) continue;  // a combine's padding row: never read
    unsigned char* row = half + kStageHeaderBytes + t * stride;
    if (!call.rows_in_place)
      warp_copy(row, static_cast<const unsigned char*>(call.x) + static_cast<long long>(t) * call.x_bytes,
                call.x_bytes, lane);
    if (combine) {
      if (weight_bytes)
        warp_copy(after + static_cast<long long>(t) * weight_bytes, call.topk_weights + static_cast<long long>(t) * call.num_topk,
                  weight_bytes, lane);
      continue;
    }
    long long at = align_up(call.x_bytes, 16);
    if (call.scale_bytes) {
      warp_copy(row + at, static_cast<const unsigned char*>(call.scales) + static_cast<long long>(t) * call.scale_bytes,
                call.scale_bytes, lane);
      at += align_up(call.scale_bytes, 16);
    }
    if (idx_bytes) {
      warp_copy(row + at, call.topk_idx + static_cast<long long>(t) * call.num_topk, idx_bytes, lane);
      at += align_up(idx_bytes, 16);
    }
    if (weight_bytes) warp_copy(row + at, call.topk_weights + static_cast<long long>(t) * call.num_topk, weight_bytes, lane);
  }
  if (!combine) {  // is_token_in_rank, for the receivers' scans
    const auto* src = reinterpret_cast<const unsigned char*>(call.in_rank);
    const long long n = static_cast<long long>(call.num_rows) * c.num_ranks;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) after[i] = src[i];
  }
}

// A caller's wait before it writes a combine's rows into half 1 itself (normal_wait_combine_half).
__global__ void wait_combine_half_kernel(NormalCommon c) { wait_released(c, 1, kNormalCombineErrorOp); }

// --------------------------------------------------------------------------------------------- exchange
// One warp: lane r tells rank r that this rank's half is staged, then waits for rank r's; the lanes check
// that every rank staged the same operation and row layout, and lane 0 writes what the receiver needs to
// size and place its rows (meta, rank_prefix), meta[0] (ok) last.
__global__ void exchange_kernel(NormalCommon c, NormalCall call) {
  const unsigned seq = current_seq(c);
  const int lane = threadIdx.x, r = c.num_ranks, me = c.rank;
  const int op = error_op(call);
  __shared__ unsigned missing, differing;
  __shared__ int rows_to[kMaxRanks][kMaxRanks];  // [source][destination]
  if (lane == 0) missing = differing = 0;
  __syncwarp();
  const auto* mine = reinterpret_cast<const StageHeader*>(half_of(c, reinterpret_cast<long long>(c.local_base), call.op));
  if (lane == 0) control_of(reinterpret_cast<long long>(c.local_base))->half_seq[half_index(call.op)] = seq;
  if (lane < r) {
    if (c.system_scope) __threadfence_system();  // the stage kernel's rows before the flag, for peers on other GPUs
    set_flag(c, lane, &control_of(c.peer_bases[lane])->ready[seq & 1u][me], static_cast<unsigned long long>(seq));
    const unsigned long long* flag = &control_of(reinterpret_cast<long long>(c.local_base))->ready[seq & 1u][lane];
    if (!wait_ready(c, flag, seq)) {
      atomicOr(&missing, 1u << lane);
    } else {
#ifdef EP_LAYER_NVSHMEM
      if (by_get(c, lane))
        nvshmem_getmem(landed_header(c, lane), half_of(c, c.peer_bases[lane], call.op), sizeof(StageHeader), lane);
#endif
      const StageHeader* peer = stage_header(c, lane, call.op);
      const bool same = __ldcg(&peer->seq) == seq && __ldcg(&peer->op) == mine->op && __ldcg(&peer->x_bytes) == mine->x_bytes &&
                        __ldcg(&peer->scale_bytes) == mine->scale_bytes && __ldcg(&peer->idx_bytes) == mine->idx_bytes &&
                        __ldcg(&peer->weight_bytes) == mine->weight_bytes &&
                        __ldcg(&peer->num_experts) == mine->num_experts;
      if (!same) atomicOr(&differing, 1u << lane);
      for (int d = 0; d < r; ++d) rows_to[lane][d] = __ldcg(&peer->rows_to_rank[d]);
    }
  }
  __syncwarp();
  if (missing || differing) {
    if (lane == 0) {
      if (missing) record_normal_error(c, op, kTimeout, missing);
      else record_normal_error(c, op, kMismatch, differing);
      call.meta[0] = 0;
    }
    return;
  }
  if (call.op == kNormalCombine) {
    if (lane == 0) call.meta[0] = 1;
    return;
  }
  bool handle_differs = false;
  if (lane < r) {  // lane d: the prefix column of destination d
    int sum = 0;
    for (int s = 0; s < r; ++s) {
      sum += rows_to[s][lane];
      if (call.op == kNormalCachedDispatch) handle_differs |= call.expected_prefix[s * r + lane] != sum;
      else call.rank_prefix[s * r + lane] = sum;
    }
  }
  if (__any_sync(0xffffffffu, handle_differs)) {
    if (lane == 0) {
      record_normal_error(c, op, kBadHandle, 0);
      call.meta[0] = 0;
    }
    return;
  }
  if (call.op == kNormalDispatch) {  // rows per local expert, from every source's num_tokens_per_expert
    const int num_local = call.num_experts / r;
    for (int l = lane; l < num_local; l += 32) {
      int sum = 0;
      for (int s = 0; s < r; ++s)
        sum += __ldcg(&stage_header(c, s, call.op)->tokens_per_expert[me * num_local + l]);
      call.meta[2 + r + l] = sum;
    }
  }
  if (lane == 0) {
    int total = 0;
    for (int s = 0; s < r; ++s) {
      call.meta[2 + s] = rows_to[s][me];
      total += rows_to[s][me];
    }
    call.meta[1] = total;
  }
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    call.meta[0] = 1;
  }
}

// ------------------------------------------------------------------------------------------------- scan
// Block s: the tokens source s sends this rank, in ascending order, as rows base_s... of the outputs
// (base_s: the rows of the sources before it); the rows past those received name source -1. A get rank's
// is_token_in_rank is fetched and scanned a window of rows at a time; one read in place is one window.
__global__ void __launch_bounds__(kScanThreads) scan_kernel(NormalCommon c, NormalCall call) {
  if (call.meta[0] == 0) return;
  const int s = blockIdx.x, r = c.num_ranks, me = c.rank;
  const int total = call.meta[1];
  int base = 0;
  for (int i = 0; i < s; ++i) base += call.meta[2 + i];
  const StageHeader* h = stage_header(c, s, call.op);
  const int rows = static_cast<int>(__ldcg(&h->num_rows));
  const long long stride = row_stride(__ldcg(&h->x_bytes), __ldcg(&h->scale_bytes), __ldcg(&h->idx_bytes),
                                      __ldcg(&h->weight_bytes));
  const unsigned char* in_rank = half_of(c, c.peer_bases[s], call.op) + after_rows(rows, stride);
  const int window = by_get(c, s) ? kScanLandingBytes / r : rows;
  __shared__ int warp_sums[kScanThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int from = 0; from < rows; from += window) {
    const int n = min(window, rows - from);
    const unsigned char* flags = in_rank + static_cast<long long>(from) * r;
#ifdef EP_LAYER_NVSHMEM
    if (by_get(c, s)) {
      nvshmemx_getmem_block(landed_in_rank(c, s), flags, static_cast<size_t>(n) * r, s);
      __syncthreads();
      flags = landed_in_rank(c, s);
    }
#endif
    // Thread i takes tokens [i * per, (i + 1) * per) of the window: count, scan the counts across the block,
    // then place.
    const int per = (n + kScanThreads - 1) / kScanThreads;
    const int first = threadIdx.x * per, last = min(first + per, n);
    int count = 0;
    for (int t = first; t < last; ++t) count += __ldcg(flags + static_cast<long long>(t) * r + me) != 0;
    int inclusive = count;
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += v;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    int pos = base + inclusive - count + (warp > 0 ? warp_sums[warp - 1] : 0);
    for (int t = first; t < last; ++t) {
      if (__ldcg(flags + static_cast<long long>(t) * r + me) == 0) continue;
      if (pos < call.out_rows) {
        call.src_idx[pos] = from + t;
        call.src_rank[pos] = s;
      }
      ++pos;
    }
    base += warp_sums[kScanThreads / 32 - 1];
    __syncthreads();  // warp_sums and the landed window are rewritten by the next window
  }
  for (int i = total + s * kScanThreads + threadIdx.x; i < call.out_rows; i += r * kScanThreads) {
    call.src_idx[i] = -1;
    call.src_rank[i] = -1;
  }
  if (s == 0 && threadIdx.x == 0 && total > call.out_rows)
    record_normal_error(c, kNormalDispatchErrorOp, kTooManyRows, 0, total);
}

// ----------------------------------------------------------------------------------------------- gather
#ifdef EP_LAYER_NVSHMEM
// The calling warp copies `bytes` at `src` of get rank r to `dst`, a landed piece at a time.
__device__ void warp_get_copy(const NormalCommon& c, void* dst, const unsigned char* src, int bytes, int r, int lane) {
  unsigned char* landing = warp_landing(c);
  for (int at = 0; at < bytes; at += kWarpLandingBytes) {
    const int n = min(kWarpLandingBytes, bytes - at);
    nvshmemx_getmem_warp(landing, src + at, n, r);
    __syncwarp();
    warp_copy(static_cast<unsigned char*>(dst) + at, landing, n, lane);
    __syncwarp();  // the landing piece is rewritten next
  }
}
#endif

// One warp per output row: the row's columns from its source's half, its top-k ids made local (-1 for
// experts of other ranks, whose weights become 0); rows of source -1 get ids -1 and weights 0. A get rank's row
// is fetched: its data a piece at a time, then the columns after it (the caller checks that they fit a piece).
__device__ void gather_rows(const NormalCommon& c, const NormalCall& call) {
  const int lane = threadIdx.x % 32, me = c.rank;
  const int k = call.num_topk;
  const int idx_bytes = call.has_idx ? 8 * k : 0, weight_bytes = call.has_weights ? 4 * k : 0;
  const long long stride = row_stride(call.x_bytes, call.scale_bytes, idx_bytes, weight_bytes);
  const int num_local = call.num_experts / c.num_ranks;
  const int warps = gridDim.x * kWarps;
  for (int n = blockIdx.x * kWarps + threadIdx.x / 32; n < call.out_rows; n += warps) {
    const int s = call.src_rank[n];
    auto* out_x = static_cast<unsigned char*>(call.out_x) + static_cast<long long>(n) * call.x_bytes;
    auto* out_scales = static_cast<unsigned char*>(call.out_scales) + static_cast<long long>(n) * call.scale_bytes;
    if (s < 0) {  // past the rows received: their data is unspecified (design.md), only the ids are set
      if (call.has_idx && lane < k) call.out_topk_idx[static_cast<long long>(n) * k + lane] = -1;
      if (call.has_weights && lane < k) call.out_weights[static_cast<long long>(n) * k + lane] = 0.f;
      continue;
    }
    const unsigned char* row = half_of(c, c.peer_bases[s], call.op) + kStageHeaderBytes + call.src_idx[n] * stride;
    const long long after_x = align_up(call.x_bytes, 16);
    const unsigned char* columns = row + after_x;  // the scales, ids and weights
#ifdef EP_LAYER_NVSHMEM
    if (by_get(c, s)) {
      warp_get_copy(c, out_x, row, call.x_bytes, s, lane);
      if (stride > after_x) {
        nvshmemx_getmem_warp(warp_landing(c), columns, stride - after_x, s);
        __syncwarp();
        columns = warp_landing(c);
      }
    } else
#endif
    {
      warp_copy(out_x, row, call.x_bytes, lane);
    }
    long long at = 0;
    if (call.scale_bytes) {
      warp_copy(out_scales, columns + at, call.scale_bytes, lane);
      at += align_up(call.scale_bytes, 16);
    }
    bool local = false;
    if (call.has_idx) {
      if (lane < k) {
        const long long id = __ldcg(reinterpret_cast<const long long*>(columns + at) + lane);
        local = id >= static_cast<long long>(me) * num_local && id < static_cast<long long>(me + 1) * num_local;
        call.out_topk_idx[static_cast<long long>(n) * k + lane] = local ? id - static_cast<long long>(me) * num_local : -1;
      }
      at += align_up(idx_bytes, 16);
    }
    if (call.has_weights && lane < k) {
      const float w = __ldcg(reinterpret_cast<const float*>(columns + at) + lane);
      call.out_weights[static_cast<long long>(n) * k + lane] = local ? w : 0.f;
    }
    if (by_get(c, s)) __syncwarp();  // the landed columns are rewritten by the next row
  }
}

__global__ void __launch_bounds__(kWarps * 32) gather_kernel(NormalCommon c, NormalCall call) {
  const unsigned seq = current_seq(c);
  if (call.meta[0] != 0) gather_rows(c, call);
  release_reads(c, 0, seq);
}

// ----------------------------------------------------------------------------------------------- reduce
// acc[j] += the j-th of the 8 bf16 values in v, in float32.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const auto* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(b[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

// One warp per token of this rank: the float32 sum of the rows the ranks it went to send back, in
// ascending rank, plus the biases, rounded once (the reference's order, so the results agree bit for bit).
// kGets: some ranks are read with NVSHMEM gets (a kernel of its own, so that their registers cannot spill the
// load/store path's row pointers).
template <bool kGets>
__device__ void reduce_rows(const NormalCommon& c, const NormalCall& call) {
  const int lane = threadIdx.x % 32, r = c.num_ranks, me = c.rank, k = call.num_topk;
  const long long stride = row_stride(call.x_bytes, 0, 0, 0);
  __shared__ const unsigned char* rows_of[kMaxRanks];  // rank d's rows from this rank, in d's half
  __shared__ const float* weights_of[kMaxRanks];       // and their top-k weights
  if (threadIdx.x < r) {
    const int base = me > 0 ? call.rank_prefix[(me - 1) * r + threadIdx.x] : 0;
    const unsigned char* half = half_of(c, c.peer_bases[threadIdx.x], call.op);
    const long long rows = static_cast<long long>(__ldcg(&stage_header(c, threadIdx.x, call.op)->num_rows));
    rows_of[threadIdx.x] = half + kStageHeaderBytes + base * stride;
    weights_of[threadIdx.x] = reinterpret_cast<const float*>(half + after_rows(rows, stride)) + static_cast<long long>(base) * k;
  }
  __syncthreads();
  const int chunks = call.x_bytes / 16;  // 8 bf16 each
  const int warps = gridDim.x * kWarps;
  const __nv_bfloat16* biases[2] = {call.bias0, call.bias1};
  for (int t = blockIdx.x * kWarps + threadIdx.x / 32; t < call.num_tokens; t += warps) {
    // Indexed by rank only (unrolled), so that the pointers stay in registers; null: not sent there.
    const unsigned char* src[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d)
      src[d] = d < r && call.in_rank[static_cast<long long>(t) * r + d]
                   ? rows_of[d] + static_cast<long long>(call.send_pos[static_cast<long long>(t) * r + d]) * stride
                   : nullptr;
    // The rows of get ranks are fetched a piece at a time (each rank's into its part of the warp's landing piece);
    // without get ranks the whole row is one piece.
    unsigned gets = 0;
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) gets |= static_cast<unsigned>(kGets && src[d] != nullptr && by_get(c, d)) << d;
    const int piece_chunks = gets ? kPieceBytes / 16 : chunks;
    for (int p0 = 0; p0 < chunks; p0 += piece_chunks) {
      const int piece = min(piece_chunks, chunks - p0);
      const unsigned char* from[kMaxRanks];  // where the piece's chunk 0 of each rank's row is read
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) from[d] = src[d] != nullptr ? src[d] + p0 * 16 : nullptr;
#ifdef EP_LAYER_NVSHMEM
      if (gets) {
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (!(gets >> d & 1u)) continue;
          unsigned char* landed = warp_landing(c) + d * kPieceBytes;
          nvshmemx_getmem_warp(landed, from[d], piece * 16, d);
          from[d] = landed;
        }
        __syncwarp();
      }
#endif
      // Two chunks per lane at a time: twice the loads in flight of one.
      for (int first = lane; first < piece; first += 64) {
        int4 v[2][kMaxRanks];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int d = 0; d < kMaxRanks; ++d)
            if (from[d] != nullptr && first + 32 * u < piece) v[u][d] = ld_peer_written(from[d] + (first + 32 * u) * 16);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int ch = p0 + first + 32 * u;
          if (first + 32 * u >= piece) break;
          float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int d = 0; d < kMaxRanks; ++d)
            if (src[d] != nullptr) add_bf16x8(acc, v[u][d]);
          const long long at = static_cast<long long>(t) * (call.x_bytes / 2) + ch * 8;
#pragma unroll
          for (int i = 0; i < 2; ++i)
            if (biases[i] != nullptr) add_bf16x8(acc, *reinterpret_cast<const int4*>(biases[i] + at));
          int4 o;
          auto* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
          for (int j = 0; j < 4; ++j) ob[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
          *reinterpret_cast<int4*>(call.out + at) = o;
        }
      }
      if (gets) __syncwarp();  // the landing piece is rewritten next
    }
    if (call.combined_weights != nullptr && lane < k) {
      float w = 0.f;
      for (int d = 0; d < r; ++d) {
        if (!call.in_rank[static_cast<long long>(t) * r + d]) continue;
        const float* weight = weights_of[d] + static_cast<long long>(call.send_pos[static_cast<long long>(t) * r + d]) * k + lane;
#ifdef EP_LAYER_NVSHMEM
        if (kGets && by_get(c, d)) {
          w += nvshmem_float_g(weight, d);
          continue;
        }
#endif
        w += __ldcg(weight);
      }
      call.combined_weights[static_cast<long long>(t) * k + lane] = w;
    }
  }
}

template <bool kGets>
__global__ void __launch_bounds__(kWarps * 32) reduce_kernel(NormalCommon c, NormalCall call) {
  const unsigned seq = current_seq(c);
  if (call.meta[0] != 0) reduce_rows<kGets>(c, call);
  release_reads(c, 1, seq);
}

// Blocks of kWarps warps for `work` rows (a warp each), at most `num_sms` of them (DeepEP's SM budget).
int copy_blocks(long long work, int num_sms) {
  const long long blocks = (work + kWarps - 1) / kWarps;
  return static_cast<int>(blocks < 1 ? 1 : blocks < num_sms ? blocks : num_sms);
}

}  // namespace

cudaError_t normal_load_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(stage_kernel), reinterpret_cast<const void*>(exchange_kernel),
                           reinterpret_cast<const void*>(scan_kernel), reinterpret_cast<const void*>(gather_kernel),
                           reinterpret_cast<const void*>(reduce_kernel<false>),
#ifdef EP_LAYER_NVSHMEM
                           reinterpret_cast<const void*>(reduce_kernel<true>),
#endif
                           reinterpret_cast<const void*>(wait_combine_half_kernel)};
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void normal_stage(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream) {
  stage_kernel<<<copy_blocks(call.num_rows, num_sms), kWarps * 32, 0, stream>>>(c, call);
}

void normal_wait_combine_half(const NormalCommon& c, cudaStream_t stream) {
  wait_combine_half_kernel<<<1, 32, 0, stream>>>(c);
}

void normal_exchange(const NormalCommon& c, const NormalCall& call, cudaStream_t stream) {
  exchange_kernel<<<1, 32, 0, stream>>>(c, call);
}

void normal_scan(const NormalCommon& c, const NormalCall& call, cudaStream_t stream) {
  scan_kernel<<<c.num_ranks, kScanThreads, 0, stream>>>(c, call);
}

// The gather and reduce with get ranks: as many blocks as the landing area has warps' pieces, at most.
int landing_sms(const NormalCommon& c, int num_sms) {
  return c.get_ranks ? std::min(num_sms, kLandingWarps / kWarps) : num_sms;
}

void normal_gather(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream) {
  gather_kernel<<<copy_blocks(call.out_rows, landing_sms(c, num_sms)), kWarps * 32, 0, stream>>>(c, call);
}

void normal_reduce(const NormalCommon& c, const NormalCall& call, int num_sms, cudaStream_t stream) {
  const int blocks = copy_blocks(call.num_tokens, landing_sms(c, num_sms));
#ifdef EP_LAYER_NVSHMEM
  if (c.get_ranks) {
    reduce_kernel<true><<<blocks, kWarps * 32, 0, stream>>>(c, call);
    return;
  }
#endif
  reduce_kernel<false><<<blocks, kWarps * 32, 0, stream>>>(c, call);
}

}  // namespace ep
