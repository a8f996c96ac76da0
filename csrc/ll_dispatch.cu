// Low-latency dispatch.
// Send half: block 0 publishes this rank's per-expert token counts to every destination (each count
// tagged with the sequence number, so a count is its own arrival flag, and with the number of tokens
// this rank sends in this call); the token blocks (one per token up to this rank's share of the GPU, then
// several tokens each) cast each token (FP8 optional) once and give every destination a slot per token:
// a header listing the experts it has there, the token's
// top-k positions and its row offset among this rank's tokens for each expert, then the payload
// (pushed into the destination's slot, or, for ranks sharing the GPU, left in the sender's own slot
// for the destination to pull); the header's flag (sequence number and number of entries) is stored
// last. Rank 0 writes its own tokens straight to their rows (no slot, nothing to receive). The loads a
// token block needs (rows, expert ids, the earlier tokens' ids for the row offsets) are issued ahead;
// the sequence ticket is only waited for where a slot needs it.
// Receive half: each block polls the counts (and the peers' hellos, for the spec check) in parallel;
// then warps take (slot, channel chunk) items of the slots the sources filled (their tokens of this
// call, not all max_tokens: a decode step's few tokens cost few slots); each waits for its slot's flag
// and copies the token straight to its rows of the GEMM-ready [E_l, R*T, H] layout (row = rows of
// earlier source ranks, from the counts, + the offset in the header): each payload is read once per
// destination, by one warp per chunk. With rows in place (recv_rows) the rows' data is not copied: each
// row gets the byte offset of the payload it would have copied, which the GEMM reads where it lies (the
// slot stays untouched until the dispatch two calls later, as recv_x's rows would), and only the FP8
// scales are written out (a GEMM wants a tile's scales side by side); rank 0's own rows then point at
// its own slot.
// Without a hook both halves run as one kernel whose blocks all fit on the GPU at once: each block
// sends its tokens, then receives; one launch and no wait for the send kernel to drain.
#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

#include "runtime.h"

#include "ll_common.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCountsPerThread = kMaxExperts / kThreads;
constexpr int kScaleWordsPerLane = 16384 / kFp8Group / 32;  // float32 scales of a row, H <= 16384
enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

// A count word: (tokens << kTokensShift) | (count << 32) | seq, the source's tokens of the call and its
// tokens for one expert (both at most MAX_TOKENS_PER_RANK = 1024, checked in Python, so 16 bits each).
constexpr int kTokensShift = 48;
constexpr unsigned kCountMask = 0xffffu;

// The FP8 rule (docs/design.md section 2) in IEEE float32: scale = max(amax, 1e-4) / 448, optionally
// rounded up to a power of two (exact: bump the exponent unless the mantissa is already zero).
__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
  float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
  if (round_scale) {
    unsigned bits = __float_as_uint(scale);
    if (bits & 0x7fffffu) bits = (bits & 0x7f800000u) + 0x00800000u;
    scale = __uint_as_float(bits);
  }
  return scale;
}

// Ranks that share this GPU pull payloads: a token's payload goes once into the sender's own slot for it
// (the one it would fill as its own destination), and every destination's receive copies it from there,
// out of the L2 they share, instead of the sender writing it to DRAM once per destination. Ranks on
// separate GPUs push: the payload goes into a slot at each destination, so that the receive reads local
// memory. Either way the destination's slot gets the header, and its flag publishes the payload.
__device__ __forceinline__ bool pull_payloads(const Common& c) { return !c.system_scope; }

// Rank 0's own tokens skip the slots: its send half writes them straight to their rows of recv_x (with rows
// in place, the payload to its own slot, which the rows name), and its receive half has none to wait for.
// Source 0's rows come first in every expert, so rank 0 places them without any other rank's counts; any
// other rank needs the counts of the ranks before it, so its own tokens go through a slot like a peer's.
__host__ __device__ __forceinline__ bool own_tokens_skip_slots(const Common& c) { return c.rank == 0; }

// The sources whose tokens arrive in slots are ranks first_slot_source(c) onward: on rank 0 all but itself
// (own_tokens_skip_slots: it is source 0), elsewhere all of them.
__host__ __device__ __forceinline__ int first_slot_source(const Common& c) { return own_tokens_skip_slots(c); }

// Rank `sender`'s slot for its token `token` in rank `owner`'s buffer: its slot at a destination, or, with
// pulled payloads, its own slot in its own buffer, where the receives read the payload.
__device__ __forceinline__ unsigned char* dispatch_slot(const Common& c, int owner, int sender, unsigned seq,
                                                        int token) {
  return half_base(c, c.peer_bases[owner], seq) + c.layout.dispatch +
         (static_cast<long long>(sender) * c.max_tokens + token) * c.layout.slot;
}

// This rank's send-area slot for its token `token` to rank `dest` (a put rank): where the header and payload
// are assembled for the put (the send area of a half is R * T slots, a multiple of 128 bytes as layout.py has it).
__device__ __forceinline__ unsigned char* send_slot(const Common& c, int dest, unsigned seq, int token) {
  const long long slots = static_cast<long long>(c.num_ranks) * c.max_tokens;
  return c.local_base + c.layout.send + ((seq & 1u) * slots + static_cast<long long>(dest) * c.max_tokens + token) *
                                            c.layout.slot;
}

// Where a slot's payload lies, as a byte offset from this rank's buffer (recv_rows; may be negative).
__device__ __forceinline__ long long payload_offset(const Common& c, const unsigned char* slot) {
  return slot + kHeaderBytes - c.local_base;
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

// Adds to bins[e] how many of tokens [0, end) chose expert e (a token counts once per expert). `ids`
// holds token threadIdx.x's ids, loaded ahead by the caller when threadIdx.x < end.
__device__ __forceinline__ void count_tokens(const DispatchCall& a, int end, int (&ids)[kMaxTopk], int* bins) {
  for (int t = threadIdx.x; t < end; t += kThreads) {
    if (t >= kThreads) load_ids(a, t, ids);
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      bool first = ids[k] >= 0;
#pragma unroll
      for (int j = 0; j < k; ++j) first &= ids[j] != ids[k];
      if (first) atomicAdd(&bins[ids[k]], 1);
    }
  }
}

// The counting block (block 0): count this rank's tokens per expert, write each destination its
// experts' counts tagged with the sequence number, then the hello (spec check). It also owns the
// call's timing: it is done long before the token blocks.
__device__ void publish_counts(const DispatchCall& a, unsigned long long start, bool fused, SendTiming& timing,
                               int* bins, unsigned& seq) {
  const Common& c = a.c;
  const int num_local = c.num_experts / c.num_ranks;
  int ids[kMaxTopk];
  if (static_cast<int>(threadIdx.x) < a.num_tokens) load_ids(a, threadIdx.x, ids);  // in flight with the ticket
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) bins[e] = 0;
  if (threadIdx.x == 0) {
    seq = take_ticket(c, kDispatch);
    begin_call_timing(c, kDispatch, seq, start, fused, timing);
  }
  __syncthreads();
  count_tokens(a, a.num_tokens, ids, bins);
  __syncthreads();
  const unsigned masked = masked_ranks(c);
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) {
    const int dest = e / num_local;
    if (masked >> dest & 1u) continue;  // nothing goes to a masked rank
    auto* counts = reinterpret_cast<unsigned long long*>(half_base(c, c.peer_bases[dest], seq) + c.layout.counts);
    const unsigned long long word = static_cast<unsigned long long>(a.num_tokens) << kTokensShift |
                                    static_cast<unsigned long long>(bins[e]) << 32 | seq;
    store_word(c, dest, counts + c.rank * num_local + e % num_local, word);
  }
  say_hello(c, kDispatch, seq);
  if (threadIdx.x == 0) {
    reinterpret_cast<Control*>(c.local_base)->receive_claims[seq & 1u] = 0;  // the hook claims from 0
    *c.ticket = seq;
  }
}

// A thread's share of a token row: kPairs pairs of 16-byte vectors, 16 consecutive channels each; pair
// p of thread i covers channels 16 * (i + p * kThreads) onward, so 8 lanes hold a 128-channel group.
template <int kPairs>
struct RowShare {
  int4 v[kPairs][2];
  __device__ __forceinline__ static int pair(int p) { return static_cast<int>(threadIdx.x) + p * kThreads; }
  // Token t's share (zeros for a token past num_tokens: nothing is loaded).
  __device__ __forceinline__ static RowShare load(const DispatchCall& a, int t, int row_pairs) {
    const int4* row = reinterpret_cast<const int4*>(a.x + static_cast<long long>(t) * a.c.hidden);
    RowShare share;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const bool here = t < a.num_tokens && pair(p) < row_pairs;
      share.v[p][0] = here ? row[2 * pair(p)] : make_int4(0, 0, 0, 0);
      share.v[p][1] = here ? row[2 * pair(p) + 1] : make_int4(0, 0, 0, 0);
    }
    return share;
  }
  // Stores the share as bf16 into a row of `row_pairs` pairs.
  __device__ __forceinline__ void store(int4* row, int row_pairs) const {
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int i = pair(p);
      if (i >= row_pairs) continue;
      row[2 * i] = v[p][0];
      row[2 * i + 1] = v[p][1];
    }
  }
};

// x / s rounded as IEEE division rounds it, from r = RN(1 / s): q0 = RN(x * r) is within an ulp of the
// quotient, so the remainder x - q0 * s is exact in one FMA and q0 + remainder * r rounds correctly
// (Markstein's theorem); three instructions instead of a division's eight and its slow-path call. The
// remainder cannot underflow where it matters: s >= 1e-4 / 448, and a quotient below 2^-10 is FP8 zero
// whatever its last bits. The sign is copied back for x = -0, which the remainder turns into +0. An
// infinite x makes s infinite (`finite` false): then r = 0 and q0 is already x / s (0 or NaN).
__device__ __forceinline__ float divide(float x, float s, float r, bool finite) {
  const float q0 = __fmul_rn(x, r);
  return finite ? copysignf(__fmaf_rn(__fmaf_rn(-s, q0, x), r, q0), x) : q0;
}

// FP8 cast of a thread's share (docs/design.md section 2, per 128-channel group): 16 FP8 bytes per pair and the
// group's scale. The kPairs casts are independent chains the compiler interleaves. A pair past the row
// is skipped by its whole 8-lane group (H is a multiple of 128), so the shuffles name only live groups.
template <int kPairs>
__device__ __forceinline__ void cast_fp8(const RowShare<kPairs>& row, int row_pairs, bool round_scale,
                                         int4 (&packed)[kPairs], float (&scales)[kPairs]) {
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const bool live = RowShare<kPairs>::pair(p) < row_pairs;
    const unsigned lanes = __ballot_sync(0xffffffffu, live);
    if (!live) continue;
    const auto* b = reinterpret_cast<const __nv_bfloat162*>(row.v[p]);
    __nv_bfloat162 m = __habs2(b[0]);  // max |x| is exact in bf16
#pragma unroll
    for (int i = 1; i < 8; ++i) m = __hmax2(m, __habs2(b[i]));
    float amax = fmaxf(__low2float(m), __high2float(m));
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, off));
    const float s = fp8_scale(amax, round_scale), r = __frcp_rn(s);
    const bool finite = isfinite(s);
    auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&packed[p]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __bfloat1622float2(b[i]);
      const float2 d = make_float2(divide(f.x, s, r, finite), divide(f.y, s, r, finite));
      q[i] = __nv_cvt_float2_to_fp8x2(d, __NV_SATFINITE, __NV_E4M3);
    }
    scales[p] = s;
  }
}

// The high half of a tagged count word from `source` ((tokens << 16) | count), given a first load of it
// (`got`); polls on while it is missing. Also watches the source's hello: a rank that disagrees on T, H
// or E writes its counts elsewhere, and its hello is what tells. Returns -1 after recording a timeout or
// mismatch, or when another thread of the block sets `*stop`; 0 (nothing from it) for a masked source,
// or, with masking, one that never came.
__device__ int wait_for_count(const Common& c, unsigned seq, const unsigned long long* word, int source,
                              unsigned long long got, const volatile int* stop) {
  if (static_cast<unsigned>(got) == seq) return static_cast<int>(got >> 32);
  if (is_masked(c, source)) return 0;
  const auto* hello = &reinterpret_cast<const Control*>(c.local_base)->hello[kDispatch][seq & 1u][source];
  WaitClock clock;
  while (static_cast<unsigned>(got = ld_relaxed(c, word)) != seq) {
    const unsigned long long h = ld_relaxed(c, hello);
    if (static_cast<unsigned>(h) == seq && static_cast<unsigned>(h >> 32) != c.spec_check) {
      record_error(c, kDispatch, kMismatch, 1u << source);
      return -1;
    }
    if (stop != nullptr && *stop) return -1;
    if (is_masked(c, source)) return 0;
    if (clock.expired(c.timeout_ns)) return peer_missed(c, kDispatch, source) ? 0 : -1;
  }
  return static_cast<int>(got >> 32);
}

__device__ __forceinline__ const unsigned long long* tagged_counts(const Common& c, unsigned seq) {
  return reinterpret_cast<const unsigned long long*>(half_base(c, reinterpret_cast<long long>(c.local_base), seq) +
                                                     c.layout.counts);
}

constexpr int kBatch = kWarps;  // tokens per pass of a token block: warp j routes token j of the pass

// Where the tokens of one pass go; warp j fills token j, lane k top-k position k. A position is the
// entry of its expert if it is the first position choosing that expert: the entry stands for all of them.
struct PassRoutes {
  int expert[kBatch][kMaxTopk];      // -1: none
  int dest[kBatch][kMaxTopk];        // the entry's destination rank; -1 where k is not an entry
  int local[kBatch][kMaxTopk];       // the expert's index on its rank
  unsigned kmask[kBatch][kMaxTopk];  // the positions choosing the expert
  int offset[kBatch][kMaxTopk];      // the entry's row offset: earlier tokens of this rank with its expert
  unsigned slot_ranks[kBatch];       // bit r: rank r gets the token in a slot
  int selfs[kBatch][kMaxTopk];       // positions of rank 0's entries on itself, ascending
  int num_selfs[kBatch];
};

// Warp j of a pass: its token's routes into row j of `r`. `own` = lane k's expert id (-1 past the top-k).
__device__ __forceinline__ void route_token(const DispatchCall& a, long long own, int j, unsigned masked,
                                            PassRoutes& r) {
  const Common& c = a.c;
  const int k = threadIdx.x % 32, num_local = c.num_experts / c.num_ranks;
  if (own < -1 || own >= c.num_experts) {
    record_error(c, kDispatch, kBadExpert, 0, static_cast<int>(own));
    own = -1;
  }
  const int e = static_cast<int>(own);
  const unsigned same = __match_any_sync(0xffffffffu, e);  // lanes that chose the same expert
  // An expert on a masked rank (`masked`: bits) has no entry: the token does not go there.
  const bool entry = e >= 0 && __ffs(same) - 1 == k && !(masked >> (e / num_local) & 1u);
  const int dest = entry ? e / num_local : -1;
  const bool self = dest == c.rank && own_tokens_skip_slots(c);
  const unsigned slot_ranks = __reduce_or_sync(0xffffffffu, entry && !self ? 1u << dest : 0u);
  const unsigned self_mask = __ballot_sync(0xffffffffu, self);
  if (k < kMaxTopk) {
    r.expert[j][k] = e;
    r.dest[j][k] = dest;
    r.local[j][k] = entry ? e % num_local : 0;
    r.kmask[j][k] = same;
    if (self) r.selfs[j][__popc(self_mask & ((1u << k) - 1))] = k;
  }
  if (k == 0) {
    r.slot_ranks[j] = slot_ranks;
    r.num_selfs[j] = __popc(self_mask);
  }
}

// The payload of token t (routes row j): one cast, stored to each slot and each row on this rank.
// Loops run over destinations outside and pairs inside: a store through a generic pointer may alias
// shared memory, so each shared load after one waits for it.
template <int kPairs>
__device__ __forceinline__ void send_payload(const DispatchCall& a, const RowShare<kPairs>& share, int t, int j,
                                             const PassRoutes& r, unsigned seq) {
  const Common& c = a.c;
  const int hidden = c.hidden, row_pairs = hidden / 16, groups = hidden / kFp8Group;
  const int num_rows = c.num_ranks * c.max_tokens, num_selfs = r.num_selfs[j];
  const auto self_row = [&](int k) { return static_cast<long long>(r.local[j][k]) * num_rows + r.offset[j][k]; };
  const unsigned slot_ranks = r.slot_ranks[j];
  if (slot_ranks == 0 && num_selfs == 0) return;
  const unsigned put_targets = slot_ranks & put_mask(c);  // the payload goes into their send-area slots
  const unsigned stored = slot_ranks & ~put_targets;
  unsigned payload_ranks = stored && pull_payloads(c) ? 1u << c.rank : stored;  // their slots holding the payload
  const bool in_place = a.recv_rows != nullptr;
  if (in_place && num_selfs > 0) payload_ranks |= 1u << c.rank;  // rank 0's own rows read its own slot
  // Bit b < kMaxRanks: the slot of rank b that a store reaches; bit kMaxRanks + d: the send slot for rank d.
  unsigned targets = payload_ranks | put_targets << kMaxRanks;
  const auto target = [&](unsigned bits) {
    const int b = __ffs(bits) - 1;
    return (b < kMaxRanks ? dispatch_slot(c, b, c.rank, seq, t) : send_slot(c, b - kMaxRanks, seq, t)) + kHeaderBytes;
  };
  const int self_copies = in_place ? 0 : num_selfs;  // rows here that get the data (in place: scales only)
  if (!a.use_fp8) {
    for (; targets; targets &= targets - 1) share.store(reinterpret_cast<int4*>(target(targets)), row_pairs);
    for (int n = 0; n < self_copies; ++n)
      share.store(reinterpret_cast<int4*>(static_cast<unsigned char*>(a.recv_x) + self_row(r.selfs[j][n]) * hidden * 2),
                  row_pairs);
    return;
  }
  int4 packed[kPairs];
  float scales[kPairs];
  cast_fp8<kPairs>(share, row_pairs, a.round_scale, packed, scales);
  const int in_group = threadIdx.x & 7;  // lane 0 of each 8 holds the group's scale for the slots
  for (; targets; targets &= targets - 1) {
    unsigned char* payload = target(targets);
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int i = RowShare<kPairs>::pair(p);
      if (i >= row_pairs) continue;
      reinterpret_cast<int4*>(payload)[i] = packed[p];
      if (in_group == 0) reinterpret_cast<float*>(payload + hidden)[i / 8] = scales[p];
    }
  }
  // Scales of the rows here: column-major, so lane in_group of each 8 stores rows in_group, in_group + 8.
  long long scale_at[2] = {-1, -1};  // element index of group 0 of the row, -1: no such row
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = in_group + 8 * h;
    if (i >= num_selfs) continue;
    const int k = r.selfs[j][i];
    scale_at[h] = static_cast<long long>(r.local[j][k]) * (a.use_ue8m0 ? groups / 4 : groups) * num_rows +
                  r.offset[j][k];
  }
  for (int i = 0; i < self_copies; ++i) {
    auto* data = reinterpret_cast<int4*>(static_cast<unsigned char*>(a.recv_x) + self_row(r.selfs[j][i]) * hidden);
#pragma unroll
    for (int p = 0; p < kPairs; ++p)
      if (RowShare<kPairs>::pair(p) < row_pairs) data[RowShare<kPairs>::pair(p)] = packed[p];
  }
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int g = RowShare<kPairs>::pair(p) / 8;
    if (g >= groups) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (scale_at[h] < 0) continue;
      if (a.use_ue8m0)  // four exponents per int: group g is byte g % 4 of int g / 4
        static_cast<unsigned char*>(a.recv_scales)[(scale_at[h] + static_cast<long long>(g / 4) * num_rows) * 4 + g % 4] =
            static_cast<unsigned char>(__float_as_uint(scales[p]) >> 23);
      else
        static_cast<float*>(a.recv_scales)[scale_at[h] + static_cast<long long>(g) * num_rows] = scales[p];
    }
  }
}

#ifdef EP_LAYER_NVSHMEM
// The puts of a pass, a warp per (token, put rank) with a flag: the send slot's entries and payload go to the
// token's slot at that rank, then its flag; a slot without entries gets just its flag (nothing to order).
__device__ void put_slots(const DispatchCall& a, int first, int n, unsigned seq,
                          const unsigned long long (&put_flags)[kBatch][kMaxRanks]) {
  const Common& c = a.c;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t payload_bytes = a.use_fp8 ? c.hidden + c.hidden / kFp8Group * 4 : 2 * c.hidden;
  constexpr size_t kEntriesAt = offsetof(DispatchHeader, entries);
  for (int p = warp; p < n * c.num_ranks; p += kWarps) {
    const int j = p / c.num_ranks, r = p % c.num_ranks;
    const unsigned long long flag = put_flags[j][r];
    if (flag == 0) continue;
    unsigned char* dst = dispatch_slot(c, r, c.rank, seq, first + j);  // a symmetric address (peer_bases[r])
    auto* dst_flag = &reinterpret_cast<DispatchHeader*>(dst)->flag;
    if (flag >> 32 == 0) {
      if (lane == 0) store_word(c, r, dst_flag, flag);
      continue;
    }
    put_with_flag(r, dst + kEntriesAt, send_slot(c, r, seq, first + j) + kEntriesAt,
                  kHeaderBytes - kEntriesAt + payload_bytes, dst_flag, flag);
  }
}
#endif

// The token blocks: block b >= 1 of `token_blocks` + 1 sends a contiguous run of tokens, kBatch per pass;
// kPairs = pairs of 16-byte vectors of a bf16 row per thread (RowShare). A pass routes its tokens in
// parallel (a warp each), then casts and stores them one after another, the next token's row loading
// while this one is stored, then releases all their slots at once: a token's chain of dependent steps
// (loads, routing, row offsets, cast, stores, flags) is long, so a block with several tokens overlaps
// them rather than running the chain once per token (ranks sharing a GPU give each rank few blocks).
// Rank 0's entries on itself go straight to their rows (own_tokens_skip_slots). Every other destination,
// a higher rank's own included, gets the token in a slot: a send never waits for a peer (a send whose
// blocks spin on a peer that has no SM left would stall until the timeout). An SM stores about 32 bytes
// per clock, so the stores are what a token costs: they are 16 bytes per lane, and a row's scales go out
// in one instruction for up to 8 rows.
template <int kPairs>
__device__ void send_tokens(const DispatchCall& a, int token_blocks, int* bins, unsigned& seq) {
  const Common& c = a.c;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row_pairs = c.hidden / 16;
  const int per_block = (a.num_tokens + token_blocks - 1) / token_blocks;
  const int begin = (blockIdx.x - 1) * per_block, end = min(begin + per_block, a.num_tokens);
  __shared__ PassRoutes routes;
  __shared__ unsigned long long put_flags[kBatch][kMaxRanks];  // per token of a pass and put rank: its flag, 0: none
  // All loads first, in flight together: the first token's row, the first pass's expert ids, and the
  // ids of the earlier tokens (one per thread) for the row offsets. Thread 0 takes the ticket and keeps
  // it in a register: the data path needs the sequence number only for slots, so with one rank (and its
  // rows copied, not left in place) nothing waits for the atomic.
  RowShare<kPairs> share = RowShare<kPairs>::load(a, begin, row_pairs);
  const auto own_id = [&](int t) {
    return lane < a.num_topk && t < end ? a.topk_idx[static_cast<long long>(t) * a.num_topk + lane] : -1ll;
  };
  long long own = own_id(begin + warp);
  const int counted = begin < end ? begin : 0;  // no offsets needed without a token
  int ids[kMaxTopk];
  if (static_cast<int>(threadIdx.x) < counted) load_ids(a, threadIdx.x, ids);
  for (int e = threadIdx.x; e < c.num_experts; e += kThreads) bins[e] = 0;
  unsigned ticket = 0;
  const unsigned masked = masked_ranks(c);
  if (threadIdx.x == 0) {
    ticket = take_ticket(c, kDispatch);
    if (c.num_ranks > 1 || a.recv_rows != nullptr) seq = ticket;
  }
  __syncthreads();
  count_tokens(a, counted, ids, bins);
  for (int first = begin; first < end; first += kBatch) {
    const int n = min(kBatch, end - first);
    if (warp < n) route_token(a, own, warp, masked, routes);
    own = own_id(first + kBatch + warp);  // the next pass's ids, in flight from here
    __syncthreads();  // also: bins hold the tokens before this pass
    // Row offset of each entry: the tokens before the pass, plus the pass's earlier tokens with its expert.
    if (warp < n && lane < a.num_topk && routes.dest[warp][lane] >= 0) {
      const int e = routes.expert[warp][lane];
      int offset = bins[e];
      for (int j = 0; j < warp; ++j)
        for (int k = 0; k < a.num_topk; ++k) offset += routes.expert[j][k] == e && routes.dest[j][k] >= 0;
      routes.offset[warp][lane] = offset;
    }
    __syncthreads();
    {  // the rows on this rank: their source token and top-k positions
      const int j = threadIdx.x / kMaxTopk, i = threadIdx.x % kMaxTopk;
      if (j < n && i < routes.num_selfs[j]) {
        const int k = routes.selfs[j][i];
        const long long row = static_cast<long long>(routes.local[j][k]) * c.num_ranks * c.max_tokens +
                              routes.offset[j][k];
        a.src_info[row] = first + j;
        a.combine_map[row] = static_cast<int>(routes.kmask[j][k] << 13 | static_cast<unsigned>(first + j));
        if (a.recv_rows) a.recv_rows[row] = payload_offset(c, dispatch_slot(c, c.rank, c.rank, seq, first + j));
      }
    }
    for (int j = 0; j < n; ++j) {
      const RowShare<kPairs> next = RowShare<kPairs>::load(a, first + j + 1 < end ? first + j + 1 : a.num_tokens,
                                                           row_pairs);
      send_payload<kPairs>(a, share, first + j, j, routes, seq);
      share = next;
    }
    if (c.num_ranks > 1) __syncthreads();  // every payload store of the pass, before the flags below
    // Every other rank gets a header for each of this call's tokens (no entries if no expert there), flag
    // last: the receive waits for the slots of the tokens the counts announced, not for all max_tokens. A
    // put rank's header is assembled in its send slot, and its flag goes out with the put below.
    const int j = threadIdx.x / kMaxRanks, r = threadIdx.x % kMaxRanks;
    if (j < kBatch) put_flags[j][r] = 0;
    // None from rank 0 to itself, none to a masked rank.
    if (j < n && r < c.num_ranks && !(r == 0 && own_tokens_skip_slots(c)) && !(masked >> r & 1u)) {
      auto* header = reinterpret_cast<DispatchHeader*>(by_put(c, r) ? send_slot(c, r, seq, first + j)
                                                                    : dispatch_slot(c, r, c.rank, seq, first + j));
      unsigned m = 0;
      for (int k = 0; k < a.num_topk; ++k) {
        if (routes.dest[j][k] != r) continue;
        header->entries[m++] = make_uint2(static_cast<unsigned>(routes.local[j][k]) | (routes.kmask[j][k] << 16),
                                          static_cast<unsigned>(routes.offset[j][k]));
      }
      const unsigned long long flag = static_cast<unsigned long long>(m) << 32 | seq;
      if (by_put(c, r)) put_flags[j][r] = flag;
      else if (m > 0) st_release(c, &header->flag, flag);  // orders the payload (and entries) before it
      else *reinterpret_cast<volatile unsigned long long*>(&header->flag) = flag;  // nothing to order
    }
#ifdef EP_LAYER_NVSHMEM
    if (put_mask(c) != 0) {
      __syncthreads();  // the send slots' headers and payloads
      put_slots(a, first, n, seq, put_flags);
    }
#endif
    if (warp < n && lane < a.num_topk && routes.dest[warp][lane] >= 0) atomicAdd(&bins[routes.expert[warp][lane]], 1);
    __syncthreads();  // the routes are rewritten by the next pass
  }
  // The kernel's barrier after this publishes the sequence number to the block.
  if (threadIdx.x == 0) seq = ticket;
}

// Polls this block's copy of the counts: counts[s][l] = tokens of source s for local expert l, and
// tokens[s] = the tokens source s sent in this call (its filled slots). Threads r < R also check rank r's
// hello (spec check). All loads go out at once; a thread polls again only for what has not arrived.
// Block 0 adds the wait for each source's counts to the wait stats (a rank that sends no token is timed
// too). Returns false (with the reason recorded) if a rank disagrees or times out.
__device__ bool receive_counts(const DispatchCall& a, unsigned seq, int* counts, int* tokens) {
  const unsigned long long begin = globaltimer();
  const Common& c = a.c;
  const int words = c.num_ranks * (c.num_experts / c.num_ranks);
  const unsigned long long* tagged = tagged_counts(c, seq);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  unsigned long long got[kCountsPerThread];
#pragma unroll
  for (int j = 0; j < kCountsPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w < words) got[j] = ld_relaxed(c, tagged + w);
  }
  if (threadIdx.x < c.num_ranks && !hello_agrees(c, kDispatch, seq, threadIdx.x)) failed = 1;
  const int num_local = c.num_experts / c.num_ranks;
#pragma unroll
  for (int j = 0; j < kCountsPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w >= words) continue;
    const int high = wait_for_count(c, seq, tagged + w, w / num_local, got[j], &failed);
    if (high < 0) failed = 1;
    counts[w] = high & kCountMask;
    if (w % num_local != 0) continue;
    tokens[w / num_local] = high >> 16;
    if (a.wait_stats && blockIdx.x == 0 && high >= 0 && static_cast<unsigned>(got[j]) != seq)
      atomicAdd(reinterpret_cast<unsigned long long*>(&a.wait_stats[w / num_local]), globaltimer() - begin);
  }
  __syncthreads();
  return failed == 0;
}

// Work items of the receive half at most: (slot, channel chunk) of the max_tokens slots of every source
// that fills slots (first_slot_source). The launcher sizes the grid from it; the sources' counts then say
// how many of the slots they filled.
__host__ __device__ __forceinline__ int receive_items(const DispatchCall& a) {
  return (a.c.num_ranks - first_slot_source(a.c)) * a.c.max_tokens * a.chunks_per_slot;
}

// The receive half's work; every thread returns here, so that all of them reach finish_recv. Block 0
// also writes recv_count, layout_range and the stats (in the fused kernel it is the counting block,
// done with its send part long before the token blocks). `may_claim`: where warps have several items
// each, they claim them one at a time from a counter, so that a warp that drew light items takes more
// and the kernel ends with its last item rather than with its unluckiest warp (a hook: its send zeroed
// the counter); otherwise each warp takes every (warps)-th item (one item per warp needs no balancing,
// and its claims would only queue on the counter; one kernel with the send: nothing zeroes a counter
// before the other blocks would claim).
__device__ void receive_tokens(const DispatchCall& a, unsigned seq, bool may_claim) {
  const Common& c = a.c;
  const int max_tokens = c.max_tokens, num_ranks = c.num_ranks, num_rows = num_ranks * max_tokens;
  const int num_local = c.num_experts / num_ranks, num_sources = num_ranks - first_slot_source(c);
  const int warps = gridDim.x * kWarps, chunks = a.chunks_per_slot;
  const bool writes_layout = blockIdx.x == 0;
  if (!writes_layout && static_cast<int>(blockIdx.x) * kWarps >= receive_items(a)) return;  // no slot here
  __shared__ int counts[kMaxExperts];  // [s][l]
  __shared__ int base[kMaxExperts];    // [s][l]: rows of local expert l that come from sources before s
  __shared__ int tokens[kMaxRanks];    // [s]: the slots source s filled
  __shared__ int items_before[kMaxRanks + 1];  // [o]: items of the sources before the o-th one
  if (!receive_counts(a, seq, counts, tokens)) return;
  if (threadIdx.x == 0) {
    items_before[0] = 0;
    for (int o = 0; o < num_sources; ++o)
      items_before[o + 1] = items_before[o] + tokens[o + first_slot_source(c)] * chunks;
  }
  for (int l = threadIdx.x; l < num_local; l += kThreads) {
    int rows = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int count = counts[s * num_local + l];
      base[s * num_local + l] = rows;
      if (writes_layout) a.layout_range[l * num_ranks + s] = (static_cast<long long>(rows) << 32) | count;
      rows += count;
    }
    if (writes_layout) {
      a.recv_count[l] = rows;
      if (a.recv_stats) a.recv_stats[l] += rows;
    }
  }
  __syncthreads();

  const int hidden = c.hidden, groups = hidden / kFp8Group, lane = threadIdx.x % 32;
  const int row_bytes = a.use_fp8 ? hidden : hidden * 2, vectors = row_bytes / 16;
  const int per_chunk = (vectors + chunks - 1) / chunks, items = items_before[num_sources];
  const bool claimed = may_claim && items > warps;
  const int scale_words = a.use_ue8m0 ? groups / 4 : groups;
  unsigned* claims = &reinterpret_cast<Control*>(c.local_base)->receive_claims[seq & 1u];
  const auto claim = [&](int after) {
    if (!claimed) return after < 0 ? static_cast<int>(blockIdx.x * kWarps + threadIdx.x / 32) : after + warps;
    int item = 0;
    if (lane == 0) item = static_cast<int>(atomicAdd(claims, 1u));
    return __shfl_sync(0xffffffffu, item, 0);
  };
  int item = claim(-1);
  for (int next; item < items; item = next) {
    next = claim(item);  // in flight while this item is copied
    int other = 0;  // the item's source, counting from first_slot_source (a short scan of at most 8)
    while (item >= items_before[other + 1]) ++other;
    const int chunk = (item - items_before[other]) % chunks, token = (item - items_before[other]) / chunks;
    const int source = other + first_slot_source(c), i = source * max_tokens + token;
    const auto* header = reinterpret_cast<const DispatchHeader*>(dispatch_slot(c, c.rank, source, seq, token));
    unsigned long long waited = 0, flag = 0;
    if (lane == 0) waited = wait_for(c, &header->flag, seq, source, &flag);
    waited = __shfl_sync(0xffffffffu, waited, 0);
    flag = __shfl_sync(0xffffffffu, flag, 0);
    __syncwarp();
    if (waited == kNeverArrived) {  // its rows stay unspecified; with masking the source is masked
      if (lane == 0) peer_missed(c, kDispatch, source);
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
    const unsigned char* slot = pull_payloads(c) && !by_put(c, source)
                                    ? dispatch_slot(c, source, source, seq, token)
                                    : reinterpret_cast<const unsigned char*>(header);
    const auto* payload = reinterpret_cast<const int4*>(slot + kHeaderBytes);
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
    for (int v0 = first; v0 < last && a.recv_rows == nullptr; v0 += 32 * kCopyBatch) {  // warp-uniform trip count
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
      a.src_info[out_row] = token;
      a.combine_map[out_row] = static_cast<int>((entry.x >> 16) << 13 | static_cast<unsigned>(i));
      if (a.recv_rows) a.recv_rows[out_row] = payload_offset(c, slot);
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

// The one dispatch kernel: `phases` = kSendPhase (hook mode's send launch), kRecvPhase (its hook) or both
// (one launch, no hook). One kernel for every phase, as DeepEP's, so that a profiler shows one dispatch
// kernel whichever way it is called (DeepEP's own test counts them). kPairs = pairs of 16-byte vectors of
// a bf16 row per thread of a token block (1, 2 or 4; at 4, H > 8192, one block per SM keeps the registers
// from spilling).
template <int kPairs>
__global__ void __launch_bounds__(kThreads, kPairs == 4 ? 1 : 2) dispatch(const __grid_constant__ DispatchCall a,
                                                                          int phases) {
  const unsigned long long start = globaltimer();
  const bool fused = phases == (kSendPhase | kRecvPhase);
  __shared__ SendTiming timing;
  __shared__ unsigned seq;
  __shared__ int bins[kMaxExperts];  // tokens per expert (the send)
  if ((phases & kSendPhase) != 0) {
    if (blockIdx.x == 0) publish_counts(a, start, fused, timing, bins, seq);  // block 0 counts: it starts first
    else send_tokens<kPairs>(a, gridDim.x - 1, bins, seq);
  } else {
    if (threadIdx.x == 0) seq = *a.c.ticket;
    mark_recv_start(a.c, kDispatch, seq, start);
  }
  __syncthreads();
  if ((phases & kRecvPhase) != 0) {
    receive_tokens(a, seq, /*may_claim=*/!fused);
    finish_recv(a.c, kDispatch, seq);  // has a barrier: the counting block may account below
    if (fused && first_block() && threadIdx.x == 0) account_previous_call(a.c, kDispatch, timing);
  } else if (threadIdx.x == 0) {
    finish_send(a.c, kDispatch, seq, timing);
  }
}

// The receive half's grid. The sources' counts are unknown at launch, so it expects each source to send
// as many tokens as this rank (a decode step's ranks mostly do): a warp per item of those, but at least a
// block per SM of this rank's share (a rank with few tokens may still receive many: with 1 token against
// 7 x 256 it receives as fast as with a grid for every slot) and at most a warp per item of all the
// max_tokens slots. Any grid is correct: when the sources send more, warps take several items each. A
// grid for every slot left 446 of 448 blocks idle at T = 1 of 256 (EP = 8): they polled the counts and
// left, on SMs that the compute beside them was waiting for.
int receive_blocks(const DispatchCall& call, int sms) {
  const int sources = call.c.num_ranks - first_slot_source(call.c);
  const int expected = (sources * call.num_tokens * call.chunks_per_slot + kWarps - 1) / kWarps;
  const int all_slots = std::min((receive_items(call) + kWarps - 1) / kWarps, 1024);
  return std::max(1, std::min(all_slots, std::max(expected, sms / call.c.gpu_share)));
}

// The kernel with the fewest row pairs per thread that hold a row (every phase of a call launches it).
auto kernel_for(const DispatchCall& call) {
  const int per_thread = (call.c.hidden / 16 + kThreads - 1) / kThreads;
  return per_thread <= 1 ? dispatch<1>
       : per_thread <= 2 ? dispatch<2>
                         : dispatch<4>;  // H <= 16384
}

// The current GPU's SMs, and the blocks of `kernel` that each holds at once (cached per device and kernel).
struct Occupancy {
  int sms, blocks_per_sm;
  int resident() const { return sms * blocks_per_sm; }
};

Occupancy occupancy(void (*kernel)(DispatchCall, int)) {
  struct Known {
    int device;
    void (*kernel)(DispatchCall, int);
    Occupancy occupancy;
  };
  static thread_local std::vector<Known> known;  // the occupancy query costs microseconds
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  for (const Known& k : known)
    if (k.device == device && k.kernel == kernel) return k.occupancy;
  Occupancy o{};
  check_cuda(cudaDeviceGetAttribute(&o.sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.blocks_per_sm, kernel, kThreads, 0),
             "the occupancy query");
  known.push_back({device, kernel, o});
  return o;
}

}  // namespace

// A token block per token, up to this rank's share of the blocks the GPU holds at once (ranks on one
// GPU share it); past that, blocks take several tokens each, which overlaps their chains of dependent
// steps instead of running them in waves.
void dispatch_send(const DispatchCall& call, cudaStream_t stream) {
  const auto kernel = kernel_for(call);
  const int share_of_resident = occupancy(kernel).resident() / call.c.gpu_share;
  const int token_blocks = std::max(1, std::min(call.num_tokens, share_of_resident - 1));
  kernel<<<token_blocks + 1, kThreads, 0, stream>>>(call, kSendPhase);
}

// Ranks on one GPU get their share of the blocks it holds at once: warps then take several slots each,
// and every rank's receive runs in one wave (a block's poll of the counts is paid once, not per wave).
void dispatch_recv(const DispatchCall& call, cudaStream_t stream) {
  const auto kernel = kernel_for(call);
  const Occupancy o = occupancy(kernel);
  const int share = call.c.gpu_share;
  int blocks = receive_blocks(call, o.sms);
  if (share > 1) blocks = std::max(1, std::min(blocks, o.resident() / share));
  kernel<<<blocks, kThreads, 0, stream>>>(call, kRecvPhase);
}

// Every block of the fused kernel must be resident at once (receivers wait for other blocks' sends),
// so the grid is capped at what the GPU holds; blocks then take several tokens each.
void dispatch_fused(const DispatchCall& call, cudaStream_t stream) {
  const auto kernel = kernel_for(call);
  const Occupancy o = occupancy(kernel);
  const int resident = o.resident();
  if (resident < 2) throw std::runtime_error("ep_layer._C: the GPU cannot hold two blocks of the dispatch kernel");
  const int wanted = std::max(call.num_tokens + 1, receive_blocks(call, o.sms));
  kernel<<<std::min(wanted, resident), kThreads, 0, stream>>>(call, kSendPhase | kRecvPhase);
}

cudaError_t set_dispatch_latency_bounds(const unsigned long long* ns, int n) {
  return set_latency_bounds_of_this_file(ns, n);
}

}  // namespace ep
