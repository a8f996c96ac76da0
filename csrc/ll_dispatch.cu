// Low-latency dispatch.
// Send half: one block publishes this rank's per-expert token counts to every destination; one
// block per token casts it (FP8 optional) once and writes it into one slot of each destination rank
// it has experts on, with a header listing those experts, the token's top-k positions and its row
// offset among this rank's tokens for each expert; the header's sequence number is stored last, so
// data and arrival flag travel together.
// Receive half: warps take (slot, channel chunk) items; each waits for its slot and copies the token
// straight to its rows of the GEMM-ready [E_l, R*T, H] layout (row = rows of earlier source ranks,
// from the counts, + the offset in the header): each slot is read once, by one warp per chunk.
#include <algorithm>

#include "ll_common.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
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

// A token's top-k expert ids, all loads in flight at once; -1 past num_topk.
__device__ __forceinline__ void load_ids(const DispatchCall& a, int token, long long (&ids)[kMaxTopk]) {
  const long long* row = a.topk_idx + static_cast<long long>(token) * a.num_topk;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) ids[k] = k < a.num_topk ? row[k] : -1;
}

// The last block: count this rank's tokens per expert (a token counts once per expert),
// write each destination its experts' counts, then announce the call (the release orders the counts).
__device__ void publish_counts(const DispatchCall& a, unsigned seq) {
  const Common& c = a.c;
  __shared__ int bins[kMaxExperts];
  const int num_local = c.num_experts / c.num_ranks;
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) bins[e] = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < a.num_tokens; t += kThreads) {
    long long ids[kMaxTopk];
    load_ids(a, t, ids);
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      bool first = ids[k] >= 0 && ids[k] < c.num_experts;
#pragma unroll
      for (int j = 0; j < k; ++j) first &= ids[j] != ids[k];
      if (first) atomicAdd(&bins[ids[k]], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) {
    const int dest = e / num_local;
    auto* counts = reinterpret_cast<int*>(half_base(c, c.peer_bases[dest], seq) + c.layout.counts);
    counts[c.rank * num_local + e % num_local] = bins[e];
  }
  __syncthreads();
  say_hello(c, kDispatch, seq);
  if (threadIdx.x == 0) *c.ticket = seq;
}

__global__ void __launch_bounds__(kThreads, 2) dispatch_send_kernel(DispatchCall a) {
  const Common& c = a.c;
  const unsigned seq = next_seq(c, kDispatch);
  __shared__ SendTiming timing;
  mark_send_start(c, kDispatch, seq, timing);
  if (blockIdx.x == gridDim.x - 1) {  // one extra block counts, in parallel with the token blocks
    publish_counts(a, seq);
    if (threadIdx.x == 0) finish_send(c, kDispatch, seq, timing);
    return;
  }
  const int num_local = c.num_experts / c.num_ranks, hidden = c.hidden, lane = threadIdx.x % 32;
  // Per top-k position k of the current token: its expert, whether k is the first position choosing
  // that expert (the entry that stands for all of them), the mask of positions choosing it, its
  // destination rank and local index, and its row offset. Thread k fills position k.
  __shared__ int experts[kMaxTopk], dest_of[kMaxTopk], local_of[kMaxTopk], positions[kMaxTopk];
  __shared__ unsigned kmasks[kMaxTopk];
  __shared__ bool is_entry[kMaxTopk];
  __shared__ int dests[kMaxRanks];
  __shared__ int num_dests;
  __shared__ unsigned dest_mask;
  __shared__ signed char entry_of[kMaxExperts];  // expert -> its entry's position k, or -1
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) entry_of[e] = -1;

  for (int t = blockIdx.x; t < c.max_tokens; t += gridDim.x - 1) {
    const bool real = t < a.num_tokens;
    if (threadIdx.x == 0) dest_mask = 0;
    if (threadIdx.x < kMaxTopk) {
      const int k = threadIdx.x;
      long long e = k < a.num_topk && real ? a.topk_idx[static_cast<long long>(t) * a.num_topk + k] : -1;
      if (e < -1 || e >= c.num_experts) {
        record_error(c, kDispatch, kBadExpert, 0, static_cast<int>(e));
        e = -1;
      }
      experts[k] = static_cast<int>(e);
      positions[k] = 0;
    }
    __syncthreads();
    if (threadIdx.x < kMaxTopk) {
      const int k = threadIdx.x, e = experts[k];
      bool first = e >= 0;
      unsigned mask = 0;
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) {
        first &= !(j < k && experts[j] == e);
        mask |= static_cast<unsigned>(experts[j] == e) << j;
      }
      is_entry[k] = first;
      kmasks[k] = mask;
      dest_of[k] = first ? e / num_local : -1;
      local_of[k] = first ? e % num_local : 0;
      if (first) {
        atomicOr(&dest_mask, 1u << dest_of[k]);
        entry_of[e] = static_cast<signed char>(k);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int d = 0;
      for (unsigned m = dest_mask; m; m &= m - 1) dests[d++] = __ffs(m) - 1;
      num_dests = d;
    }
    __syncthreads();
    // The payload first: its stores drain while the row offsets below are computed.
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
    // Row offset of each entry: how many earlier tokens of this rank chose the same expert.
    for (int base = 0; num_dests > 0 && base < t; base += kThreads) {
      const int earlier = base + threadIdx.x;
      unsigned hit = 0;  // bit k: the earlier token chose the expert of position k
      if (earlier < t) {
        long long earlier_ids[kMaxTopk];
        load_ids(a, earlier, earlier_ids);
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          const int j = earlier_ids[k] >= 0 && earlier_ids[k] < c.num_experts ? entry_of[earlier_ids[k]] : -1;
          if (j >= 0) hit |= 1u << j;
        }
      }
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) {
        const unsigned votes = __ballot_sync(0xffffffffu, (hit >> j) & 1u);
        if (lane == 0 && votes) atomicAdd(&positions[j], __popc(votes));
      }
    }

    __syncthreads();
    if (threadIdx.x < kMaxTopk && is_entry[threadIdx.x]) entry_of[experts[threadIdx.x]] = -1;  // next token
    // Every destination gets a header for every token slot (empty if no expert there), flag last.
    if (threadIdx.x < c.num_ranks) {
      const int r = threadIdx.x;
      auto* header = reinterpret_cast<DispatchHeader*>(dispatch_slot(c, r, seq, t));
      int m = 0;
      for (int k = 0; k < kMaxTopk; ++k) {
        if (dest_of[k] != r) continue;
        header->entries[m++] = make_uint2(static_cast<unsigned>(local_of[k]) | (kmasks[k] << 16),
                                          static_cast<unsigned>(positions[k]));
      }
      header->token = t;
      header->num_entries = m;
      st_release(c, &header->seq, seq);
    }
    __syncthreads();
  }
  // Block 0 settles the timing here (it has token 0, the least work: no earlier tokens to count).
  if (threadIdx.x == 0) finish_send(c, kDispatch, seq, timing);
}

// The receive half's work; every thread returns here, so that all of them reach finish_recv.
__device__ __forceinline__ void receive_tokens(const DispatchCall& a, unsigned seq) {
  const Common& c = a.c;
  if (!check_hellos(c, kDispatch, seq)) return;  // a hello is released after its counts

  const int num_tokens = c.max_tokens, num_ranks = c.num_ranks, num_rows = num_ranks * num_tokens;
  const int num_local = c.num_experts / num_ranks;
  const unsigned char* half = half_base(c, reinterpret_cast<long long>(c.local_base), seq);
  // base[s][l]: rows of local expert l that come from source ranks before s.
  __shared__ int base[kMaxExperts];
  const int* counts = reinterpret_cast<const int*>(half + c.layout.counts);
  for (int l = threadIdx.x; l < num_local; l += kThreads) {
    int rows = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int count = __ldcg(counts + s * num_local + l);
      base[s * num_local + l] = rows;
      if (blockIdx.x == 0) a.layout_range[l * num_ranks + s] = (static_cast<long long>(rows) << 32) | count;
      rows += count;
    }
    if (blockIdx.x == 0) {
      a.recv_count[l] = rows;
      if (a.recv_stats) a.recv_stats[l] += rows;
    }
  }
  __syncthreads();

  const unsigned char* slots = half + c.layout.dispatch;
  const int hidden = c.hidden, groups = hidden / kFp8Group, lane = threadIdx.x % 32;
  const int row_bytes = a.use_fp8 ? hidden : hidden * 2, vectors = row_bytes / 16;
  const int chunks = a.chunks_per_slot, per_chunk = (vectors + chunks - 1) / chunks;
  const int items = num_rows * chunks, warps = gridDim.x * kWarps;
  for (int item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += warps) {
    const int i = item / chunks, chunk = item % chunks, source = i / num_tokens;
    const auto* header = reinterpret_cast<const DispatchHeader*>(slots + i * c.layout.slot);
    unsigned long long waited = 0;
    if (lane == 0) waited = wait_for(c, &header->seq, seq);
    waited = __shfl_sync(0xffffffffu, waited, 0);
    __syncwarp();
    if (waited == kNeverArrived) {
      if (lane == 0) record_error(c, kDispatch, kTimeout, 1u << source);
      continue;
    }
    const int n = __ldcg(&header->num_entries);
    if (n == 0) continue;
    // Lane j < n owns entry j: its expert, top-k mask and destination row.
    int expert = 0, row = 0;
    if (lane < n) {
      const uint2 entry = __ldcg(&header->entries[lane]);
      expert = static_cast<int>(entry.x & 0xffffu);
      row = base[source * num_local + expert] + static_cast<int>(entry.y);
      if (chunk == 0) {
        const long long out_row = static_cast<long long>(expert) * num_rows + row;
        a.src_info[out_row] = i % num_tokens;
        a.combine_map[out_row] = static_cast<int>((entry.x >> 16) << 13 | static_cast<unsigned>(i));
      }
    }
    if (chunk == 0 && lane == 0 && a.wait_stats)
      atomicAdd(reinterpret_cast<unsigned long long*>(&a.wait_stats[source]), waited);
    // This chunk of the payload: loaded once, stored to each of the token's rows here.
    const auto* payload = reinterpret_cast<const int4*>(reinterpret_cast<const unsigned char*>(header) + kHeaderBytes);
    const int first = chunk * per_chunk, last = min(vectors, first + per_chunk);
    for (int v0 = first; v0 < last; v0 += 32 * kCopyBatch) {  // warp-uniform trip count: shuffles below
      const int v = v0 + lane;
      int4 r[kCopyBatch];
#pragma unroll
      for (int u = 0; u < kCopyBatch; ++u)
        if (v + u * 32 < last) r[u] = ld_peer_written(payload + v + u * 32);
      for (int j = 0; j < n; ++j) {
        const long long out_row = static_cast<long long>(__shfl_sync(0xffffffffu, expert, j)) * num_rows +
                                  __shfl_sync(0xffffffffu, row, j);
        auto* dst = reinterpret_cast<int4*>(static_cast<unsigned char*>(a.recv_x) + out_row * row_bytes);
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
          if (v + u * 32 < last) dst[v + u * 32] = r[u];
      }
    }
    if (!a.use_fp8 || chunk != chunks - 1) continue;
    // Scales, column-major [E_l, G, R*T] (or UE8M0: four exponents per int), by the last chunk.
    const auto* scales = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(payload) + hidden);
    const int words = a.use_ue8m0 ? groups / 4 : groups;
    for (int w0 = 0; w0 < words; w0 += 32) {  // warp-uniform trip count: shuffles below
      const int w = w0 + lane;
      unsigned value = 0;
      if (w < words && a.use_ue8m0) {
        for (int q = 0; q < 4; ++q) value |= ((__float_as_uint(__ldcg(scales + w * 4 + q)) >> 23) & 0xffu) << (8 * q);
      } else if (w < words) {
        value = __float_as_uint(__ldcg(scales + w));
      }
      for (int j = 0; j < n; ++j) {
        const int e = __shfl_sync(0xffffffffu, expert, j), r = __shfl_sync(0xffffffffu, row, j);
        if (w < words) static_cast<unsigned*>(a.recv_scales)[(static_cast<long long>(e) * words + w) * num_rows + r] = value;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(DispatchCall a) {
  const unsigned long long start = globaltimer();
  const unsigned seq = *a.c.ticket;
  mark_recv_start(a.c, kDispatch, seq, start);
  receive_tokens(a, seq);
  finish_recv(a.c, kDispatch, seq);
}

}  // namespace

void dispatch_send(const DispatchCall& call, cudaStream_t stream) {
  dispatch_send_kernel<<<call.c.max_tokens + 1, kThreads, 0, stream>>>(call);
}

cudaError_t set_dispatch_latency_bounds(const unsigned long long* ns, int n) {
  return set_latency_bounds_of_this_file(ns, n);
}

void dispatch_recv(const DispatchCall& call, cudaStream_t stream) {
  const long long items = static_cast<long long>(call.c.num_ranks) * call.c.max_tokens * call.chunks_per_slot;
  const int blocks = static_cast<int>(std::min<long long>((items + kWarps - 1) / kWarps, 1024));
  dispatch_recv_kernel<<<blocks, kThreads, 0, stream>>>(call);
}

}  // namespace ep
