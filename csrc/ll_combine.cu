// Low-latency combine. Send half (expert rank): one warp per received row writes the expert output
// into slot [token][k] of the source rank's buffer, then its flag (sequence number + where to read);
// rows of this rank's own tokens are not copied at all, the flag points the receiver at them in
// place, and neither are rows that already lie in this rank's buffer (zero-copy combine) when the
// ranks share the GPU: the flag points the receiver at the row there, which it reads through its
// mapping of this buffer. When no row is copied (one rank, or zero-copy on a shared GPU) the send half
// only writes flags, a thread per row, in blocks small enough to run beside the expert GEMM's programs
// on the same SM. Receive half (source rank): one block per (token, channel chunk) waits for each of
// the token's top-k flags in ascending k and accumulates w * y in float32, rounded once to bf16.
//
// A flag's reference: >= 0, a row of the receiver's own x; -1 - k, combine slot [token][k]; below
// -kMaxTopk, row -ref - kMaxTopk - 1 of the sending rank's buffer (2H bytes a row).
//
// Without a hook both halves run in one kernel (combine_fused): send blocks first, reducers after.
#include <algorithm>
#include <stdexcept>

#include "runtime.h"

#include "ll_common.cuh"

namespace ep {
namespace {

constexpr int kSendThreads = 256;  // rows copied: a warp per row
// Flags only: a thread per row. 128 threads of at most 64 registers (8K) fit beside the expert GEMM's two
// programs of an SM (moe/triton_experts.py), so the send starts at once instead of holding up the GEMM's
// programs while it waits for an SM to drain.
constexpr int kFlagThreads = 128;
constexpr int kRecvThreads = 128;
constexpr int kMapTokenBits = 13;  // combine_map: (k mask << 13) | (source rank * T + token)

__device__ __forceinline__ unsigned long long* combine_flag(const Common& c, unsigned char* half, int token, int k) {
  return reinterpret_cast<unsigned long long*>(half + c.layout.flags) + token * kMaxTopk + k;
}

__device__ __forceinline__ unsigned char* combine_slot(const Common& c, unsigned char* half, int token, int k) {
  return half + c.layout.combine + (static_cast<long long>(token) * kMaxTopk + k) * c.hidden * 2;
}

#ifdef EP_LAYER_NVSHMEM
// A warp's row for a put rank (kCopies): put from the stage area (the row is copied there first unless x is
// that area: a put's source lies on the symmetric heap) into slot [token][k] of `source` for each position k
// choosing the expert, each followed by its flag.
__device__ __forceinline__ void put_row(const CombineCall& a, unsigned seq, long long in_row, int token, unsigned kmask,
                                        int source, unsigned char* half) {
  const Common& c = a.c;
  const int lane = threadIdx.x % 32, row_bytes = c.hidden * 2;
  unsigned char* staged = c.local_base + (a.stage_row + in_row) * row_bytes;
  const auto* row = reinterpret_cast<const unsigned char*>(a.x + in_row * c.hidden);
  if (staged != row) {
    copy_vectors(reinterpret_cast<int4*>(staged), reinterpret_cast<const int4*>(row), c.hidden / 8, lane, 32);
    __syncwarp();
  }
  for (unsigned m = kmask; m; m &= m - 1) {
    const int k = __ffs(m) - 1;
    const unsigned long long flag = (static_cast<unsigned long long>(static_cast<unsigned>(-(k + 1))) << 32) | seq;
    put_with_flag(source, combine_slot(c, half, token, k), staged, row_bytes, combine_flag(c, half, token, k), flag);
  }
}
#endif

// Single-batch overlap: whether row `row` of local expert `expert` is complete, waiting for its signal to reach
// the threshold (the expert GEMM, on another stream, counts its finished tiles there). Bounded: after the
// timeout it records which signal and says no (the row is not sent; its receiver times out too).
__device__ __forceinline__ bool row_signalled(const CombineCall& a, int expert, int row) {
  const int index = expert * a.signals_per_expert + row / a.signal_rows;
  const auto* signal = reinterpret_cast<const unsigned*>(a.signals + index);
  if (static_cast<int>(ld_acquire(a.c, signal)) >= a.signal_threshold) return true;
  WaitClock clock;
  while (static_cast<int>(ld_acquire(a.c, signal)) < a.signal_threshold) {
    if (clock.expired(a.c.timeout_ns)) {
      record_error(a.c, kCombine, kSignalTimeout, 0u, index);
      return false;
    }
  }
  return true;
}

// The send half's rows of one (expert, row group) work item: kCopies, rows of other ranks' tokens are
// copied into their slots (a warp per row); else every row is read where it lies and only its flags go
// out (a thread per row). `workers` rows per pass, `row_groups` groups per expert.
template <bool kCopies>
__device__ __forceinline__ void send_rows(const CombineCall& a, unsigned seq, int expert, int group, int row_groups) {
  const Common& c = a.c;
  const int num_rows = c.num_ranks * c.max_tokens;
  const int count = a.recv_count[expert];  // in flight with the ticket
  const unsigned masked = masked_ranks(c);  // their tokens get nothing back
  const int workers = kCopies ? blockDim.x / 32 : blockDim.x;
  const int worker = kCopies ? threadIdx.x / 32 : threadIdx.x, lane = kCopies ? threadIdx.x % 32 : 0;
  for (int row = group * workers + worker; row < count; row += row_groups * workers) {
    if (a.signals != nullptr) {
      // Each lane's own acquire makes the GEMM's rows visible to it; a warp's lanes share the row, and the
      // vote keeps them together should one time out.
      bool signalled = row_signalled(a, expert, row);
      if constexpr (kCopies) signalled = __all_sync(0xffffffffu, signalled);
      if (!signalled) continue;
    }
    const long long in_row = static_cast<long long>(expert) * num_rows + row;
    const unsigned map = static_cast<unsigned>(a.combine_map[in_row]);
    const int i = static_cast<int>(map & ((1u << kMapTokenBits) - 1));
    const unsigned kmask = map >> kMapTokenBits;
    const int source = i / c.max_tokens, token = i % c.max_tokens;
    const int first_k = __ffs(kmask) - 1;
    if (masked >> source & 1u) continue;  // warp-uniform: a warp's lanes share the row
    unsigned char* half = half_base(c, c.peer_bases[source], seq);
    int ref;
    if (source == c.rank) {
      ref = static_cast<int>(in_row);  // our own token: the receive half reads x in place
#ifdef EP_LAYER_NVSHMEM
    } else if (by_put(c, source)) {
      if constexpr (kCopies) put_row(a, seq, in_row, token, kmask, source, half);  // the launcher picks kCopies
      continue;
#endif
    } else if (!kCopies || a.x_row >= 0) {  // compile-time true without copies: no copy code, few registers
      ref = -kMaxTopk - 1 - static_cast<int>(a.x_row + in_row);  // in our buffer: the receive half pulls it
    } else {
      copy_vectors(reinterpret_cast<int4*>(combine_slot(c, half, token, first_k)),
                   reinterpret_cast<const int4*>(a.x + in_row * c.hidden), c.hidden / 8, lane, 32);
      ref = -(first_k + 1);  // data in slot [token][first_k]
    }
    if constexpr (kCopies) __syncwarp();
    if (lane == 0) {
      const unsigned long long flag = (static_cast<unsigned long long>(static_cast<unsigned>(ref)) << 32) | seq;
      for (unsigned m = kmask; m; m &= m - 1) st_release(c, combine_flag(c, half, token, __ffs(m) - 1), flag);
    }
  }
}

// Thread 0 of every block of a launch that starts a combine: the call's sequence number, and for block 0
// the start of its timing record (`fused`: the launch does both halves).
__device__ __forceinline__ unsigned start_combine(const CombineCall& a, unsigned long long start, bool fused,
                                                  SendTiming& timing) {
  const unsigned seq = take_ticket(a.c, kCombine);
  if (first_block()) begin_call_timing(a.c, kCombine, seq, start, fused, timing);
  return seq;
}

// The receive half's work for one (token, channel chunk), after the block has checked the peers'
// hellos; threads return here, so that all of them reach the caller's next barrier. With no tokens a
// receive still runs one block that waits for the hellos and marks the receive span: the wait is what
// keeps a rank from reusing a buffer half too early. With two
// micro-batches (send A, send B, ..., combine A, combine B) a rank whose micro-batch B is empty would
// otherwise leave combine B at once and send the next B into the half its peers may still be reading.
__device__ __forceinline__ void reduce_token(const CombineCall& a, unsigned seq, int token, int chunk) {
  const Common& c = a.c;
  const int num_local = c.num_experts / c.num_ranks;
  const int vec = chunk * blockDim.x + threadIdx.x;
  unsigned char* half = half_base(c, reinterpret_cast<long long>(c.local_base), seq);
  __shared__ const int4* rows[kMaxTopk];  // per k: where its expert output is, null if no expert
  __shared__ float weights[kMaxTopk];
  __shared__ int aborted;
  if (threadIdx.x == 0) aborted = 0;
  __syncthreads();
  // Thread k waits for the output of the token's k-th expert: all waits overlap.
  if (threadIdx.x < a.num_topk) {
    const int k = threadIdx.x;
    const long long expert = a.topk_idx[static_cast<long long>(token) * a.num_topk + k];
    weights[k] = a.topk_weights[static_cast<long long>(token) * a.num_topk + k];
    const int4* row = nullptr;
    const int rank = static_cast<int>(expert / num_local);
    // An expert of a masked rank counts as -1 (rank masking), and so with masking does one that timed out.
    if (expert >= 0 && expert < c.num_experts && !is_masked(c, rank)) {
      unsigned long long flag;
      const unsigned long long waited = wait_for(c, combine_flag(c, half, token, k), seq, rank, &flag);
      if (waited == kNeverArrived) {
        if (!peer_missed(c, kCombine, rank)) aborted = 1;
      } else {
        const int ref = static_cast<int>(flag >> 32);
        if (ref >= 0)
          row = reinterpret_cast<const int4*>(a.x + static_cast<long long>(ref) * c.hidden);
        else if (ref >= -kMaxTopk)
          row = reinterpret_cast<const int4*>(combine_slot(c, half, token, -ref - 1));
        else
          row = reinterpret_cast<const int4*>(c.peer_bases[rank] + (-static_cast<long long>(ref) - kMaxTopk - 1) *
                                                                       c.hidden * 2);
        if (a.wait_stats && chunk == 0)
          atomicAdd(reinterpret_cast<unsigned long long*>(&a.wait_stats[rank]), waited);
      }
    }
    rows[k] = row;
  }
  __syncthreads();
  if (aborted || vec >= c.hidden / 8) return;

  // Ascending k, float32, one rounding at the end: the summation order of docs/design.md section 2.
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const unsigned long long read_once = evict_first_policy();
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
    if (k >= a.num_topk || rows[k] == nullptr) continue;
    const int4 v = ld_peer_written(rows[k] + vec, read_once);
    const auto* y = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(weights[k], __bfloat162float(y[j])));
  }
  int4 packed;
  auto* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16_rn(acc[j]);
  reinterpret_cast<int4*>(a.out + static_cast<long long>(token) * c.hidden)[vec] = packed;
}

enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

// The one combine kernel, as DeepEP's (a profiler shows one combine kernel whichever way it is called), on
// a 1-D grid: its first `send_blocks` blocks send (the (local expert, row group) items, blocks_per_expert
// groups per expert, each a share of the expert's rows: an item per block, or several in turn where
// send_sms caps the blocks), the rest reduce (token, channel chunk) items in turn. `phases`:
// - kSendPhase (hook mode's send launch): every block sends;
// - kRecvPhase (its hook): no block sends, a block of kRecvThreads per item;
// - both (one launch, no hook): senders never wait and come first in block order, and the grid is capped
//   at what the GPU holds at once, so every reducer's wait has its senders running.
// The three share one code path, so that a launch runs no more code than a kernel per phase did.
template <bool kCopies>
__global__ void __launch_bounds__(kCopies ? kSendThreads : kFlagThreads)
    combine(const __grid_constant__ CombineCall a, int phases, int send_blocks) {
  const unsigned long long start = globaltimer();
  const bool sends = (phases & kSendPhase) != 0;
  const bool fused = phases == (kSendPhase | kRecvPhase);
  __shared__ SendTiming timing;
  __shared__ unsigned seq;
  // A hook's receive takes the sequence number its send launch left.
  if (threadIdx.x == 0) seq = sends ? start_combine(a, start, fused, timing) : *a.c.ticket;
  __syncthreads();
  const int block = blockIdx.x;
  if (block < send_blocks) {
    if (block == 0) {
      say_hello(a.c, kCombine, seq);
      if (!fused && threadIdx.x == 0) *a.c.ticket = seq;
    }
    const int items = a.c.num_experts / a.c.num_ranks * a.blocks_per_expert;
    for (int item = block; item < items; item += send_blocks)
      send_rows<kCopies>(a, seq, item / a.blocks_per_expert, item % a.blocks_per_expert, a.blocks_per_expert);
    // A send launch's blocks settle its timing (block 0 after its rows: its hello went out first thing).
    if (threadIdx.x == 0) {
      if (fused)
        red_max(&timing_record(a.c, kCombine, seq).recv_end, globaltimer());
      else
        finish_send(a.c, kCombine, seq, timing);
    }
  } else {
    if (!sends) mark_recv_start(a.c, kCombine, seq, start);
    if (check_hellos(a.c, kCombine, seq)) {
      const int chunks = (a.c.hidden / 8 + blockDim.x - 1) / blockDim.x;
      for (int item = block - send_blocks; item < a.num_tokens * chunks; item += gridDim.x - send_blocks) {
        reduce_token(a, seq, item / chunks, item % chunks);
        __syncthreads();  // the next item reuses the shared rows, weights and abort flag
      }
      finish_recv(a.c, kCombine, seq);
    } else if (!sends) {
      finish_recv(a.c, kCombine, seq);  // a hook's receive notes its end whatever its peers said
    }
  }
  if (fused && block == 0 && threadIdx.x == 0) account_previous_call(a.c, kCombine, timing);
}

// Whether the send half moves rows (a warp each): to a peer that cannot read them where they lie, or by puts.
bool copies_rows(const CombineCall& call) {
  const bool put_peers = (call.c.put_ranks & ~(1u << call.c.rank)) != 0;
  return put_peers || !(call.x_row >= 0 || call.c.num_ranks == 1);
}

}  // namespace

void combine_send(const CombineCall& call, cudaStream_t stream) {
  const int items = call.c.num_experts / call.c.num_ranks * call.blocks_per_expert;
  const int blocks = call.send_sms > 0 ? std::min(items, call.send_sms) : items;
  if (!copies_rows(call))
    combine<false><<<blocks, kFlagThreads, 0, stream>>>(call, kSendPhase, blocks);
  else
    combine<true><<<blocks, kSendThreads, 0, stream>>>(call, kSendPhase, blocks);
}

// The fused kernel's grid: the send kernel's blocks, then a reducer per (token, chunk) item, up to what
// the GPU holds at once (reducers then take several items each); at least one reducer, which with no
// tokens waits for the peers' hellos as the receive kernel does.
void combine_fused(const CombineCall& call, cudaStream_t stream) {
  // Its senders would wait on the GEMM while its reducers hold the SMs the GEMM needs: overlap and a cap on
  // the senders' SMs take the send and receive launches (ep_layer.backends.cuda does so).
  if (call.signals != nullptr || call.send_sms > 0)
    throw std::runtime_error("ep_layer._C: a combine with overlap signals or send_sms runs as two launches");
  const bool copies = copies_rows(call);
  const auto kernel = copies ? combine<true> : combine<false>;
  const int threads = copies ? kSendThreads : kFlagThreads;
  static thread_local int resident[2][64] = {};  // per variant and device: the occupancy query costs microseconds
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  int& fits = resident[copies][device % 64];
  if (fits == 0) {
    int sms = 0, per_sm = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0), "the occupancy query");
    fits = sms * per_sm;
  }
  const int send_blocks = call.c.num_experts / call.c.num_ranks * call.blocks_per_expert;
  const int items = call.num_tokens * ((call.c.hidden / 8 + threads - 1) / threads);
  if (fits < send_blocks + 1)
    throw std::runtime_error("ep_layer._C: the GPU cannot hold the combine kernel's send blocks and a reducer");
  kernel<<<send_blocks + std::max(1, std::min(items, fits - send_blocks)), threads, 0, stream>>>(
      call, kSendPhase | kRecvPhase, send_blocks);
}

cudaError_t set_combine_latency_bounds(const unsigned long long* ns, int n) {
  return set_latency_bounds_of_this_file(ns, n);
}

// The send launch's kernel (the same `kCopies`), as the hook's receive launch of it.
void combine_recv(const CombineCall& call, cudaStream_t stream) {
  const int items = call.num_tokens * ((call.c.hidden / 8 + kRecvThreads - 1) / kRecvThreads);
  const auto kernel = copies_rows(call) ? combine<true> : combine<false>;
  kernel<<<std::max(1, items), kRecvThreads, 0, stream>>>(call, kRecvPhase, 0);
}

}  // namespace ep
