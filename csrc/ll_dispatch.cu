// Low-latency dispatch. Send half: one block per token casts it (FP8 optional) once and writes it,
// with a header naming its experts there, into one slot of each destination rank's buffer; the
// header's sequence number is stored last, so data and arrival flag travel together. Receive half:
// one block per (local expert, row chunk) waits for the slots, orders the rows by (source, token)
// with a block scan, and copies them into the GEMM-ready [E_l, R*T, H] layout.
#include <cub/block/block_scan.cuh>

#include "ll_common.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlotsPerThread = 2;  // dispatch slots a receiving thread inspects per pass
constexpr int kRecvBlocksPerSm = 3;  // so that one expert per block fits in one wave up to ~400 experts
constexpr int kMaxGroupsPerHalfWarp = 16384 / kFp8Group / (kThreads / 16);  // H <= 16384

// DESIGN.md's FP8 rule in IEEE float32: scale = max(amax, 1e-4) / 448, optionally rounded up to a
// power of two (exact: bump the exponent unless the mantissa is already zero).
__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
  float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
  if (round_scale) {
    unsigned bits = __float_as_uint(scale);
    if (bits & 0x7fffffu) bits = (bits & 0x7f800000u) + 0x00800000u;
    scale = __uint_as_float(bits);
  }
  return scale;
}

__device__ __forceinline__ unsigned char* dispatch_slot(const Common& c, int dest, unsigned seq, int token) {
  return half_base(c, c.peer_bases[dest], seq) + c.layout.dispatch +
         (static_cast<long long>(c.rank) * c.max_tokens + token) * c.layout.slot;
}

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchCall a) {
  const Common& c = a.c;
  const unsigned seq = next_seq(c, kDispatch);
  if (blockIdx.x == 0) {
    say_hello(c, kDispatch, seq);
    if (threadIdx.x == 0) *c.ticket = seq;
  }
  const int num_local = c.num_experts / c.num_ranks;
  const int hidden = c.hidden;
  __shared__ int num_entries[kMaxRanks];
  __shared__ unsigned entries[kMaxRanks][kMaxTopk];
  __shared__ int dests[kMaxRanks];
  __shared__ int num_dests;
  __shared__ unsigned dest_mask;

  for (int t = blockIdx.x; t < c.max_tokens; t += gridDim.x) {
    if (threadIdx.x < c.num_ranks) num_entries[threadIdx.x] = 0;
    if (threadIdx.x == 0) dest_mask = 0;
    __syncthreads();
    // Thread k routes the token's k-th expert; the order of entries in a header does not matter.
    if (threadIdx.x < a.num_topk && t < a.num_tokens) {
      const int k = threadIdx.x;
      const long long e = a.topk_idx[static_cast<long long>(t) * a.num_topk + k];
      if (e < -1 || e >= c.num_experts) {
        record_error(c, kDispatch, kBadExpert, 0, static_cast<int>(e));
      } else if (e >= 0) {
        const int r = static_cast<int>(e) / num_local, l = static_cast<int>(e) % num_local;
        entries[r][atomicAdd(&num_entries[r], 1)] = (static_cast<unsigned>(l) << 8) | k;
        atomicOr(&dest_mask, 1u << r);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int n = 0;
      for (unsigned m = dest_mask; m; m &= m - 1) dests[n++] = __ffs(m) - 1;
      num_dests = n;
    }
    __syncthreads();

    const __nv_bfloat16* row = a.x + static_cast<long long>(t) * hidden;
    if (num_dests > 0 && a.use_fp8) {
      // A half-warp casts one 128-channel group, 8 channels (16 bytes) per lane. All of this
      // thread's loads are issued first (at most kMaxGroupsPerHalfWarp) so their latencies overlap.
      const int groups = hidden / kFp8Group, lane = threadIdx.x % 16;
      const int first = threadIdx.x / 16, step = kThreads / 16;
      int4 loaded[kMaxGroupsPerHalfWarp];
#pragma unroll
      for (int j = 0; j < kMaxGroupsPerHalfWarp; ++j) {
        const int g = first + j * step;
        if (g < groups) loaded[j] = *reinterpret_cast<const int4*>(row + g * kFp8Group + lane * 8);
      }
#pragma unroll
      for (int j = 0; j < kMaxGroupsPerHalfWarp; ++j) {
        const int g = first + j * step;
        if (first + j * step - first % 2 >= groups) break;  // warp-uniform: both half-warps stop together
        const bool valid = g < groups;
        float f[8];
        float amax = 0.f;
        const auto* b = reinterpret_cast<const __nv_bfloat16*>(&loaded[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          f[i] = valid ? __bfloat162float(b[i]) : 0.f;
          amax = fmaxf(amax, fabsf(f[i]));
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (!valid) continue;
        const float scale = fp8_scale(amax, a.round_scale);
        uint2 packed;
        auto* q = reinterpret_cast<__nv_fp8_storage_t*>(&packed);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = __nv_cvt_float_to_fp8(__fdiv_rn(f[i], scale), __NV_SATFINITE, __NV_E4M3);
        for (int d = 0; d < num_dests; ++d) {
          unsigned char* payload = dispatch_slot(c, dests[d], seq, t) + kHeaderBytes;
          *reinterpret_cast<uint2*>(payload + g * kFp8Group + lane * 8) = packed;
          if (lane == 0) reinterpret_cast<float*>(payload + hidden)[g] = scale;
        }
      }
    } else {
      for (int d = 0; d < num_dests; ++d)
        copy_vectors(reinterpret_cast<int4*>(dispatch_slot(c, dests[d], seq, t) + kHeaderBytes),
                     reinterpret_cast<const int4*>(row), hidden / 8, threadIdx.x, kThreads);
    }
    __syncthreads();
    // Every destination gets a header for every token slot (empty if no expert there), flag last.
    if (threadIdx.x < c.num_ranks) {
      const int r = threadIdx.x;
      auto* header = reinterpret_cast<DispatchHeader*>(dispatch_slot(c, r, seq, t));
      header->token = t;
      header->num_entries = num_entries[r];
      for (int i = 0; i < num_entries[r]; ++i) header->entries[i] = entries[r][i];
      st_release(c, &header->seq, seq);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) finish_send(c, kDispatch, seq);
}

__global__ void __launch_bounds__(kThreads, kRecvBlocksPerSm) dispatch_recv_kernel(DispatchCall a) {
  using Scan = cub::BlockScan<int, kThreads>;
  const Common& c = a.c;
  const int expert = blockIdx.x, chunk = blockIdx.y, num_chunks = gridDim.y;
  const unsigned seq = *c.ticket;
  if (!check_hellos(c, kDispatch, seq)) return;

  const int num_tokens = c.max_tokens, num_ranks = c.num_ranks, num_rows = num_ranks * num_tokens;
  extern __shared__ unsigned row_info[];  // per received row: slot index | (k mask << 16)
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int per_source[kMaxRanks];
  __shared__ unsigned long long waited[kMaxRanks];
  __shared__ int total, aborted;
  if (threadIdx.x < num_ranks) per_source[threadIdx.x] = 0, waited[threadIdx.x] = 0;
  if (threadIdx.x == 0) total = 0, aborted = 0;
  __syncthreads();

  const unsigned char* slots = half_base(c, reinterpret_cast<long long>(c.local_base), seq) + c.layout.dispatch;
  const bool measure = a.wait_stats != nullptr && expert == 0 && chunk == 0;
  // Each pass covers kThreads * per_thread slots in (source, token) order, each thread a run of
  // consecutive slots, so that all its waits and header loads are in flight together.
  const int per_thread = min(kSlotsPerThread, (num_rows + kThreads - 1) / kThreads);
  for (int base = 0; base < num_rows; base += kThreads * per_thread) {
    const int first = base + threadIdx.x * per_thread;
    int4 words[kSlotsPerThread][kHeaderBytes / 16];
#pragma unroll
    for (int j = 0; j < kSlotsPerThread; ++j) {
      const int i = first + j;
      if (j >= per_thread || i >= num_rows) continue;
      const auto* header = reinterpret_cast<const DispatchHeader*>(slots + i * c.layout.slot);
      const unsigned long long waited_ns = wait_for(c, &header->seq, seq);
      if (waited_ns == kNeverArrived) {
        record_error(c, kDispatch, kTimeout, 1u << (i / num_tokens));
        aborted = 1;
      } else if (measure) {
        atomicAdd(&waited[i / num_tokens], waited_ns);
      }
#pragma unroll
      for (int w = 0; w < kHeaderBytes / 16; ++w) words[j][w] = ld_peer_written(reinterpret_cast<const int4*>(header) + w);
    }
    unsigned kmask[kSlotsPerThread];
    int has[kSlotsPerThread], pos[kSlotsPerThread], pass_rows;
#pragma unroll
    for (int j = 0; j < kSlotsPerThread; ++j) {
      kmask[j] = 0;
      const auto* h = reinterpret_cast<const DispatchHeader*>(words[j]);
#pragma unroll
      for (int e = 0; e < kMaxTopk; ++e)
        if (j < per_thread && first + j < num_rows && e < h->num_entries &&
            static_cast<int>(h->entries[e] >> 8) == expert)
          kmask[j] |= 1u << (h->entries[e] & 0xffu);
      has[j] = kmask[j] ? 1 : 0;
    }
    Scan(scan_storage).ExclusiveSum(has, pos, pass_rows);
#pragma unroll
    for (int j = 0; j < kSlotsPerThread; ++j) {
      if (!kmask[j]) continue;
      row_info[total + pos[j]] = static_cast<unsigned>(first + j) | (kmask[j] << 16);
      atomicAdd(&per_source[(first + j) / num_tokens], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) total += pass_rows;
    __syncthreads();
  }
  if (aborted) return;

  const int count = total;
  if (chunk == 0) {
    if (threadIdx.x == 0) {
      a.recv_count[expert] = count;
      if (a.recv_stats) a.recv_stats[expert] += count;
    }
    if (threadIdx.x < num_ranks) {
      long long begin = 0;
      for (int s = 0; s < threadIdx.x; ++s) begin += per_source[s];
      a.layout_range[expert * num_ranks + threadIdx.x] = (begin << 32) | per_source[threadIdx.x];
    }
  }
  if (measure && threadIdx.x < num_ranks)
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.wait_stats[threadIdx.x]), waited[threadIdx.x]);

  // Copy this chunk's rows, one warp per row.
  const int hidden = c.hidden, groups = hidden / kFp8Group;
  const int per_chunk = (count + num_chunks - 1) / num_chunks;
  const int row_end = min(count, (chunk + 1) * per_chunk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int row = chunk * per_chunk + warp; row < row_end; row += kWarps) {
    const unsigned info = row_info[row];
    const int i = static_cast<int>(info & 0xffffu);
    const long long out_row = static_cast<long long>(expert) * num_rows + row;
    const unsigned char* payload = slots + i * c.layout.slot + kHeaderBytes;
    if (lane == 0) {
      a.src_info[out_row] = i % num_tokens;
      a.combine_map[out_row] = static_cast<int>((info >> 16) << 13 | static_cast<unsigned>(i));
    }
    const int row_bytes = a.use_fp8 ? hidden : hidden * 2;
    copy_vectors(reinterpret_cast<int4*>(static_cast<unsigned char*>(a.recv_x) + out_row * row_bytes),
                 reinterpret_cast<const int4*>(payload), row_bytes / 16, lane, 32);
    if (!a.use_fp8) continue;
    const auto* scales = reinterpret_cast<const float*>(payload + hidden);
    if (!a.use_ue8m0) {
      auto* out = static_cast<float*>(a.recv_scales);
      for (int g = lane; g < groups; g += 32)
        out[(static_cast<long long>(expert) * groups + g) * num_rows + row] = __ldcg(scales + g);
    } else {  // four biased exponents per int, group g in byte g % 4
      auto* out = static_cast<int*>(a.recv_scales);
      for (int p = lane; p < groups / 4; p += 32) {
        unsigned packed = 0;
        for (int q = 0; q < 4; ++q) packed |= ((__float_as_uint(__ldcg(scales + p * 4 + q)) >> 23) & 0xffu) << (8 * q);
        out[(static_cast<long long>(expert) * (groups / 4) + p) * num_rows + row] = static_cast<int>(packed);
      }
    }
  }
}

}  // namespace

void dispatch_send(const DispatchCall& call, cudaStream_t stream) {
  const int blocks = call.c.max_tokens;
  dispatch_send_kernel<<<blocks, kThreads, 0, stream>>>(call);
}

void dispatch_recv(const DispatchCall& call, cudaStream_t stream) {
  const dim3 grid(call.c.num_experts / call.c.num_ranks, call.blocks_per_expert);
  const size_t smem = sizeof(unsigned) * call.c.num_ranks * call.c.max_tokens;
  dispatch_recv_kernel<<<grid, kThreads, smem, stream>>>(call);
}

}  // namespace ep
