// Low-latency dispatch.
// Send half: one block publishes this rank's per-expert token counts to every destination (each count
// tagged with the sequence number, so a count is its own arrival flag); one block per token casts it
// (FP8 optional) once and writes it into one slot of each destination rank it has experts on, with a
// header listing those experts, the token's top-k positions and its row offset among this rank's
// tokens for each expert; the header's flag (sequence number and number of entries) is stored last.
// Every global load a token block needs (its row, its expert ids, the earlier tokens' ids for the row
// offsets, the sequence ticket) is issued at once at its start.
// Receive half: each block polls the counts (and the peers' hellos, for the spec check) in parallel;
// then warps take (slot, channel chunk) items; each waits for its slot's flag and copies the token
// straight to its rows of the GEMM-ready [E_l, R*T, H] layout (row = rows of earlier source ranks,
// from the counts, + the offset in the header): each slot is read once, by one warp per chunk.
// Without a hook both halves run as one kernel whose blocks all fit on the GPU at once: each block
// sends its tokens, then receives; one launch and no wait for the send kernel to drain.
#include <algorithm>

#include "ll_common.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowVectors = 16384 * 2 / 16 / kThreads;  // 16-byte vectors of a bf16 row per thread, H <= 16384
constexpr int kCountsPerThread = kMaxExperts / kThreads;
constexpr int kScaleWordsPerLane = 16384 / kFp8Group / 32;  // float32 scales of a row, H <= 16384
enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

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

// A token's top-k expert ids, all loads in flight at once; -1 past num_topk and for ids outside [0, E)
// (the token's own block reports those).
__device__ __forceinline__ void load_ids(const DispatchCall& a, int token, int (&ids)[kMaxTopk]) {
  const long long* row = a.topk_idx + static_cast<long long>(token) * a.num_topk;
  long long raw[kMaxTopk];
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) raw[k] = k < a.num_topk ? row[k] : -1;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) ids[k] = raw[k] >= 0 && raw[k] < a.c.num_experts ? static_cast<int>(raw[k]) : -1;
}

// The block that starts a call: thread 0 takes the ticket and, in block 0, starts the call's timing.
__device__ __forceinline__ void start_call(const DispatchCall& a, unsigned long long start, bool fused,
                                           SendTiming& timing, unsigned& seq) {
  if (threadIdx.x == 0) {
    seq = take_ticket(a.c, kDispatch);
    if (first_block()) begin_call_timing(a.c, kDispatch, seq, start, fused, timing);
  }
}

// The counting block: count this rank's tokens per expert (a token counts once per expert), write each
// destination its experts' counts tagged with the sequence number, then the hello (spec check).
__device__ void publish_counts(const DispatchCall& a, unsigned long long start, bool fused, SendTiming& timing,
                               unsigned& seq) {
  const Common& c = a.c;
  __shared__ int bins[kMaxExperts];
  const int num_local = c.num_experts / c.num_ranks;
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) bins[e] = 0;
  start_call(a, start, fused, timing, seq);
  __syncthreads();
  for (int t = threadIdx.x; t < a.num_tokens; t += kThreads) {
    int ids[kMaxTopk];
    load_ids(a, t, ids);
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      bool first = ids[k] >= 0;
#pragma unroll
      for (int j = 0; j < k; ++j) first &= ids[j] != ids[k];
      if (first) atomicAdd(&bins[ids[k]], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) {
    const int dest = e / num_local;
    auto* counts = reinterpret_cast<unsigned long long*>(half_base(c, c.peer_bases[dest], seq) + c.layout.counts);
    const unsigned long long word = static_cast<unsigned long long>(bins[e]) << 32 | seq;
    *reinterpret_cast<volatile unsigned long long*>(counts + c.rank * num_local + e % num_local) = word;
  }
  say_hello(c, kDispatch, seq);
  if (threadIdx.x == 0) *c.ticket = seq;
}

// The token blocks: token t = blockIdx.x, blockIdx.x + stride, ...; returns the sequence number.
__device__ void send_tokens(const DispatchCall& a, int stride, unsigned long long start, bool fused,
                            SendTiming& timing, unsigned& seq) {
  const Common& c = a.c;
  const int num_local = c.num_experts / c.num_ranks, hidden = c.hidden, lane = threadIdx.x % 32;
  const int row_vectors = hidden / 8;
  // Per top-k position k of the current token: its expert, whether k is the first position choosing
  // that expert (the entry that stands for all of them), the mask of positions choosing it, its
  // destination rank and local index, and its row offset. Thread k fills position k.
  __shared__ int experts[kMaxTopk], dest_of[kMaxTopk], local_of[kMaxTopk], positions[kMaxTopk];
  __shared__ unsigned kmasks[kMaxTopk];
  __shared__ bool is_entry[kMaxTopk];
  __shared__ int dests[kMaxRanks];
  __shared__ int num_dests;
  __shared__ signed char entry_of[kMaxExperts];  // expert -> its entry's position k, or -1
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) entry_of[e] = -1;

  bool first_token = true;
  for (int t = blockIdx.x; t < c.max_tokens; t += stride) {
    const bool real = t < a.num_tokens;
    // All loads first, in flight together: the row (vector v = threadIdx.x + j * kThreads, which is
    // also lane % 16's 8 channels of 128-channel group v / 16 for the FP8 cast), this token's expert
    // ids, and the ids of the first kThreads earlier tokens (one per thread) for the row offsets.
    const int4* row = reinterpret_cast<const int4*>(a.x + static_cast<long long>(t) * hidden);
    int4 loaded[kRowVectors];
#pragma unroll
    for (int j = 0; j < kRowVectors; ++j) {
      const int v = threadIdx.x + j * kThreads;
      if (real && v < row_vectors) loaded[j] = row[v];
    }
    long long own = -1;
    if (threadIdx.x < a.num_topk && real) own = a.topk_idx[static_cast<long long>(t) * a.num_topk + threadIdx.x];
    int earlier_ids[kMaxTopk];
    if (real && static_cast<int>(threadIdx.x) < t) load_ids(a, threadIdx.x, earlier_ids);
    if (first_token) start_call(a, start, fused, timing, seq);
    first_token = false;
    if (threadIdx.x < kMaxTopk) {
      if (own < -1 || own >= c.num_experts) {
        record_error(c, kDispatch, kBadExpert, 0, static_cast<int>(own));
        own = -1;
      }
      experts[threadIdx.x] = static_cast<int>(own);
      positions[threadIdx.x] = 0;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: lane k < kMaxTopk works out position k
      const int k = lane, e = k < kMaxTopk ? experts[k] : -1;
      bool first = e >= 0;
      unsigned mask = 0;
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) {
        first &= !(j < k && experts[j] == e);
        mask |= static_cast<unsigned>(experts[j] == e) << j;
      }
      if (k < kMaxTopk) {
        is_entry[k] = first;
        kmasks[k] = mask;
        dest_of[k] = first ? e / num_local : -1;
        local_of[k] = first ? e % num_local : 0;
        if (first) entry_of[e] = static_cast<signed char>(k);
      }
      const unsigned dest_mask = __reduce_or_sync(0xffffffffu, first ? 1u << (e / num_local) : 0u);
      if (lane == 0) {
        int d = 0;
        for (unsigned m = dest_mask; m; m &= m - 1) dests[d++] = __ffs(m) - 1;
        num_dests = d;
      }
    }
    __syncthreads();
    // The payload: its stores drain while the row offsets below are computed.
    if (num_dests > 0 && a.use_fp8) {
      // A half-warp casts one 128-channel group, 8 channels (16 bytes) per lane.
#pragma unroll
      for (int j = 0; j < kRowVectors; ++j) {
        const int v = threadIdx.x + j * kThreads, g = v / 16;
        if (static_cast<int>(threadIdx.x & ~31u) + j * kThreads >= row_vectors) break;  // warp-uniform
        const bool valid = v < row_vectors;  // both half-warps of a warp run the shuffles together
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
          *reinterpret_cast<uint2*>(payload + v * 8) = packed;
          if ((lane & 15) == 0) reinterpret_cast<float*>(payload + hidden)[g] = scale;
        }
      }
    } else if (num_dests > 0) {
      for (int d = 0; d < num_dests; ++d) {
        auto* payload = reinterpret_cast<int4*>(dispatch_slot(c, dests[d], seq, t) + kHeaderBytes);
#pragma unroll
        for (int j = 0; j < kRowVectors; ++j) {
          const int v = threadIdx.x + j * kThreads;
          if (v < row_vectors) payload[v] = loaded[j];
        }
      }
    }
    // Row offset of each entry: how many earlier tokens of this rank chose the same expert.
    for (int base = 0; num_dests > 0 && base < t; base += kThreads) {
      const int earlier = base + threadIdx.x;
      if (base > 0 && earlier < t) load_ids(a, earlier, earlier_ids);  // beyond the first kThreads
      unsigned hit = 0;  // bit k: the earlier token chose the expert of position k
      if (earlier < t) {
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          const int j = earlier_ids[k] >= 0 ? entry_of[earlier_ids[k]] : -1;
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
    // Every destination gets a header for every token slot (no entries if no expert there), flag last.
    if (threadIdx.x < c.num_ranks) {
      const int r = threadIdx.x;
      auto* header = reinterpret_cast<DispatchHeader*>(dispatch_slot(c, r, seq, t));
      unsigned m = 0;
      for (int k = 0; k < kMaxTopk; ++k) {
        if (dest_of[k] != r) continue;
        header->entries[m++] = make_uint2(static_cast<unsigned>(local_of[k]) | (kmasks[k] << 16),
                                          static_cast<unsigned>(positions[k]));
      }
      st_release(c, &header->flag, static_cast<unsigned long long>(m) << 32 | seq);
    }
    __syncthreads();  // the shared state above is rewritten for the next token
  }
  if (first_token) {  // no token for this block (fused kernel, T < blocks): it still takes its ticket
    start_call(a, start, fused, timing, seq);
    __syncthreads();
  }
}

// Polls this block's copy of the counts: counts[s][l] = tokens of source s for local expert l. Threads
// r < R also check rank r's hello (spec check). All loads go out at once; a thread polls again only for
// what has not arrived. Returns false (with the reason recorded) if a rank disagrees or times out.
__device__ bool receive_counts(const DispatchCall& a, unsigned seq, const unsigned char* half, int* counts) {
  const Common& c = a.c;
  const int words = c.num_ranks * (c.num_experts / c.num_ranks);
  const auto* tagged = reinterpret_cast<const unsigned long long*>(half + c.layout.counts);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  unsigned long long got[kCountsPerThread];
#pragma unroll
  for (int j = 0; j < kCountsPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w < words) got[j] = ld_relaxed(c, tagged + w);
  }
  if (threadIdx.x < c.num_ranks) {
    const auto* ctrl = reinterpret_cast<const Control*>(c.local_base);
    unsigned long long v;
    if (wait_for(c, &ctrl->hello[kDispatch][seq & 1u][threadIdx.x], seq, &v) == kNeverArrived) {
      record_error(c, kDispatch, kTimeout, 1u << threadIdx.x);
      failed = 1;
    } else if (static_cast<unsigned>(v >> 32) != c.spec_check) {
      record_error(c, kDispatch, kMismatch, 1u << threadIdx.x);
      failed = 1;
    }
  }
  const int num_local = c.num_experts / c.num_ranks;
#pragma unroll
  for (int j = 0; j < kCountsPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w >= words) continue;
    if (static_cast<unsigned>(got[j]) != seq) {
      const unsigned long long begin = globaltimer();
      while (static_cast<unsigned>(got[j] = ld_relaxed(c, tagged + w)) != seq) {
        if (*reinterpret_cast<volatile int*>(&failed)) break;  // a disagreeing rank never writes here
        if (globaltimer() - begin > c.timeout_ns) {
          record_error(c, kDispatch, kTimeout, 1u << (w / num_local));
          failed = 1;
          break;
        }
      }
    }
    counts[w] = static_cast<int>(got[j] >> 32);
  }
  __syncthreads();
  return failed == 0;
}

// The receive half's work; every thread returns here, so that all of them reach finish_recv.
__device__ void receive_tokens(const DispatchCall& a, unsigned seq) {
  const Common& c = a.c;
  const int num_tokens = c.max_tokens, num_ranks = c.num_ranks, num_rows = num_ranks * num_tokens;
  const int num_local = c.num_experts / num_ranks;
  const unsigned char* half = half_base(c, reinterpret_cast<long long>(c.local_base), seq);
  __shared__ int counts[kMaxExperts];  // [s][l]
  __shared__ int base[kMaxExperts];    // [s][l]: rows of local expert l that come from sources before s
  if (!receive_counts(a, seq, half, counts)) return;
  for (int l = threadIdx.x; l < num_local; l += kThreads) {
    int rows = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int count = counts[s * num_local + l];
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
  const int scale_words = a.use_ue8m0 ? groups / 4 : groups;
  const int items = num_rows * chunks, warps = gridDim.x * kWarps;
  for (int item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += warps) {
    const int i = item / chunks, chunk = item % chunks, source = i / num_tokens;
    const auto* header = reinterpret_cast<const DispatchHeader*>(slots + i * c.layout.slot);
    unsigned long long waited = 0, flag = 0;
    if (lane == 0) waited = wait_for(c, &header->flag, seq, &flag);
    waited = __shfl_sync(0xffffffffu, waited, 0);
    flag = __shfl_sync(0xffffffffu, flag, 0);
    __syncwarp();
    if (waited == kNeverArrived) {
      if (lane == 0) record_error(c, kDispatch, kTimeout, 1u << source);
      continue;
    }
    if (chunk == 0 && lane == 0 && a.wait_stats)
      atomicAdd(reinterpret_cast<unsigned long long*>(&a.wait_stats[source]), waited);
    const int n = static_cast<int>(flag >> 32);
    if (n == 0) continue;
    // Entries, scales and the first payload batch are loaded together. Lane j < n owns entry j: its
    // expert, top-k mask and destination row.
    uint2 entry = make_uint2(0, 0);
    if (lane < n) entry = __ldcg(&header->entries[lane]);
    const auto* payload = reinterpret_cast<const int4*>(reinterpret_cast<const unsigned char*>(header) + kHeaderBytes);
    const bool scales_here = a.use_fp8 && chunk == chunks - 1;
    unsigned scale_value[kScaleWordsPerLane] = {};  // scale words lane, lane + 32, ...
    if (scales_here) {
      const auto* scales = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(payload) + hidden);
#pragma unroll
      for (int h = 0; h < kScaleWordsPerLane; ++h) {
        const int w = lane + 32 * h;
        if (w < scale_words && a.use_ue8m0) {
#pragma unroll
          for (int q = 0; q < 4; ++q)
            scale_value[h] |= ((__float_as_uint(__ldcg(scales + w * 4 + q)) >> 23) & 0xffu) << (8 * q);
        } else if (w < scale_words) {
          scale_value[h] = __float_as_uint(__ldcg(scales + w));
        }
      }
    }
    const int first = chunk * per_chunk, last = min(vectors, first + per_chunk);
    int expert = 0, row = 0;
    bool placed = false;
    for (int v0 = first; v0 < last; v0 += 32 * kCopyBatch) {  // warp-uniform trip count: shuffles below
      const int v = v0 + lane;
      int4 r[kCopyBatch];
#pragma unroll
      for (int u = 0; u < kCopyBatch; ++u)
        if (v + u * 32 < last) r[u] = ld_peer_written(payload + v + u * 32);
      if (!placed) {
        expert = static_cast<int>(entry.x & 0xffffu);
        row = base[source * num_local + expert] + static_cast<int>(entry.y);
        placed = true;
      }
      for (int j = 0; j < n; ++j) {
        const long long out_row = static_cast<long long>(__shfl_sync(0xffffffffu, expert, j)) * num_rows +
                                  __shfl_sync(0xffffffffu, row, j);
        auto* dst = reinterpret_cast<int4*>(static_cast<unsigned char*>(a.recv_x) + out_row * row_bytes);
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
          if (v + u * 32 < last) dst[v + u * 32] = r[u];
      }
    }
    if (!placed) {  // an empty chunk (more chunks than vectors)
      expert = static_cast<int>(entry.x & 0xffffu);
      row = base[source * num_local + expert] + static_cast<int>(entry.y);
    }
    if (chunk == 0 && lane < n) {
      const long long out_row = static_cast<long long>(expert) * num_rows + row;
      a.src_info[out_row] = i % num_tokens;
      a.combine_map[out_row] = static_cast<int>((entry.x >> 16) << 13 | static_cast<unsigned>(i));
    }
    if (!scales_here) continue;
    // Scales, column-major [E_l, G, R*T] (or UE8M0: four exponents per int).
    for (int j = 0; j < n; ++j) {
      const int e = __shfl_sync(0xffffffffu, expert, j), r = __shfl_sync(0xffffffffu, row, j);
#pragma unroll
      for (int h = 0; h < kScaleWordsPerLane; ++h) {
        const int w = lane + 32 * h;
        if (w < scale_words)
          static_cast<unsigned*>(a.recv_scales)[(static_cast<long long>(e) * scale_words + w) * num_rows + r] =
              scale_value[h];
      }
    }
  }
}

// kPhases = kSendPhase (hook mode's send kernel), kRecvPhase (its hook) or both (one kernel, no hook).
template <int kPhases>
__global__ void __launch_bounds__(kThreads, 2) dispatch_kernel(DispatchCall a) {
  const unsigned long long start = globaltimer();
  constexpr bool kFused = kPhases == (kSendPhase | kRecvPhase);
  __shared__ SendTiming timing;
  __shared__ unsigned seq;
  if (kPhases & kSendPhase) {
    if (blockIdx.x == gridDim.x - 1) publish_counts(a, start, kFused, timing, seq);  // one block counts
    else send_tokens(a, gridDim.x - 1, start, kFused, timing, seq);
  } else {
    if (threadIdx.x == 0) seq = *a.c.ticket;
    mark_recv_start(a.c, kDispatch, seq, start);
  }
  __syncthreads();
  if (kPhases & kRecvPhase) {
    receive_tokens(a, seq);
    finish_recv(a.c, kDispatch, seq);  // has a barrier: block 0 may account below
    if (kFused && first_block() && threadIdx.x == 0) account_previous_call(a.c, kDispatch, timing);
  } else if (threadIdx.x == 0) {
    finish_send(a.c, kDispatch, seq, timing);
  }
}

int receive_blocks(const DispatchCall& call) {
  const long long items = static_cast<long long>(call.c.num_ranks) * call.c.max_tokens * call.chunks_per_slot;
  return static_cast<int>(std::min<long long>((items + kWarps - 1) / kWarps, 1024));
}

}  // namespace

void dispatch_send(const DispatchCall& call, cudaStream_t stream) {
  dispatch_kernel<kSendPhase><<<call.c.max_tokens + 1, kThreads, 0, stream>>>(call);
}

void dispatch_recv(const DispatchCall& call, cudaStream_t stream) {
  dispatch_kernel<kRecvPhase><<<receive_blocks(call), kThreads, 0, stream>>>(call);
}

// Every block of the fused kernel must be resident at once (receivers wait for other blocks' sends),
// so the grid is capped at what the GPU holds (`resident_blocks`, from the occupancy calculator).
void dispatch_fused(const DispatchCall& call, int resident_blocks, cudaStream_t stream) {
  const int wanted = std::max(call.c.max_tokens + 1, receive_blocks(call));
  dispatch_kernel<kSendPhase | kRecvPhase><<<std::min(wanted, resident_blocks), kThreads, 0, stream>>>(call);
}

int dispatch_fused_resident_blocks() {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_kernel<kSendPhase | kRecvPhase>, kThreads, 0) !=
          cudaSuccess)
    return 0;
  return sms * per_sm;
}

cudaError_t set_dispatch_latency_bounds(const unsigned long long* ns, int n) {
  return set_latency_bounds_of_this_file(ns, n);
}

}  // namespace ep
