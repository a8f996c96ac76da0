// Shared pieces of the low-latency kernels: the control block at the start of every rank's buffer,
// error recording, memory-ordering primitives for peer memory, and the per-call argument structs.
// Byte offsets inside the buffer come from ep_layer/layout.py (one source of truth) as arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>
#if defined(EP_LAYER_NVSHMEM) && defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep {

// kMaxTopk, kMaxRanks, kControlBytes, kHeaderBytes and kMaxExperts have Python twins in ep_layer/layout.py;
// ep_layer/native.py checks that both agree when the module loads (bindings.cpp exports them).
constexpr int kMaxTopk = 16;
constexpr int kMaxRanks = 8;
constexpr int kControlBytes = 4096;  // reserved for the Control block at the start of every rank's buffer
// The header (flag, pad, kMaxTopk entries: 144 bytes) padded to whole 128-byte lines, so that a payload
// starts on a line: a GEMM reading rows in place then reads whole lines (a slot's size is unchanged:
// the payload, 2H bytes for H a multiple of 128, rounds the slot up to a line anyway).
constexpr int kHeaderBytes = 256;
constexpr int kMaxExperts = 1024;
constexpr int kFp8Group = 128;
constexpr float kFp8Max = 448.f;
constexpr float kAmaxFloor = 1e-4f;

enum Op : int { kDispatch = 0, kCombine = 1 };
// kSignalTimeout: a combine's overlap signal (detail: its index) stayed below the threshold for the timeout.
enum ErrorCode : int { kOk = 0, kTimeout = 1, kMismatch = 2, kBadExpert = 3, kSignalTimeout = 4 };

// Written by the device when a call fails; read by the host in Buffer.check().
struct ErrorRecord {
  int code;         // first ErrorCode recorded
  int op;           // Op of that failure
  unsigned ranks;   // bitmask: ranks that did not arrive (timeout) or disagree (mismatch)
  int detail;       // the offending expert id for kBadExpert, the signal's index for kSignalTimeout
};

// Latency of one call = send span + receive span (globaltimer, ns), accounted later (deferred) so that
// no kernel waits for it. Each call has a record, [seq % kTimingRecords] per Op: the send kernel's block
// 0 starts it, every block of the send kernel notes its end with a fire-and-forget max, the receive
// kernel's block 0 notes its start and every receive block its end. Two calls of an Op may be in flight
// (two micro-batches, one per buffer half), and a call's receive always runs before the send of the call
// after next (that send reuses the half), so block 0 of the send of call seq adds call seq - 2 to the
// histogram: it fetches that record at its start (cp.async, no wait) and adds it at its end. With four
// records, the record being added is never one that a running kernel writes. Calls not yet added when
// the host reads the histogram are added there (CudaBackend). The ends are maxima of a clock that only
// goes forward, so a record's ends need no reset: the last call's value is always the largest.
struct alignas(16) TimingRecord {
  unsigned long long send_start;  // when block 0 of the send kernel started
  unsigned long long send_end;    // latest end of a send block (red.max)
  unsigned long long recv_start;  // ~(start of the receive kernel's block 0); 0 = no receive yet
  unsigned long long recv_end;    // latest end of a receive block (red.max)
};
static_assert(sizeof(TimingRecord) == 32, "two 16-byte cp.async per record");
constexpr int kTimingRecords = 4;
struct Timing {
  TimingRecord call[kTimingRecords];
};

// Sequence numbers: every block of a launch adds to its Op's counter, 1 << kLaunchShift per launch in
// total (block 0 adds the rest), so the counter is a multiple of it whenever a launch starts (launches of
// an Op on one buffer are stream-ordered) and every block of a launch reads the same multiple: no block
// waits for another and none has to publish anything at its end.
constexpr int kLaunchShift = 20;  // > log2(blocks of any launch)

// First kControlBytes of each rank's buffer.
struct Control {
  unsigned long long launches[2];  // per Op: the launch counter above
  ErrorRecord error;
  // hello[op][half][src]: (spec check << 32) | seq, written by rank src into this rank's buffer at a
  // place that does not depend on T or H, so that disagreeing ranks are detected rather than waited
  // for at the wrong offsets.
  unsigned long long hello[2][2][kMaxRanks];
  Timing timing[2];                // per Op
  // Per buffer half: the dispatch receive's work items claimed so far (zeroed by the call's send).
  unsigned receive_claims[2];
};
static_assert(sizeof(Control) <= kControlBytes, "Control must fit kControlBytes");

// Slot header of a dispatched token (kHeaderBytes), followed by its payload. One entry per local
// expert of the destination that the token goes to: x = local expert | (mask of its top-k positions
// << 16), y = the token's position among this source's tokens for that expert (its row offset). The
// flag, stored last with release, carries the number of entries with the sequence number, so that a
// receiver learns both in one load and skips a slot without entries at once.
struct DispatchHeader {
  unsigned long long flag;  // (num_entries << 32) | seq
  unsigned long long pad;
  uint2 entries[kMaxTopk];
  unsigned char line_pad[kHeaderBytes - 16 - 8 * kMaxTopk];
};
static_assert(sizeof(DispatchHeader) == kHeaderBytes, "header layout");

struct BufferOffsets {  // byte offsets: ep_layer/layout.py's BufferOffsets, the same fields
  long long control;     // = kControlBytes: start of half 0
  long long half;        // bytes of one half
  long long dispatch;    // offset of the dispatch slots inside a half
  long long slot;        // bytes of one dispatch slot
  long long combine;     // offset of the combine slots inside a half
  long long flags;       // offset of the combine flags inside a half
  long long counts;      // offset of the per-source expert counts inside a half: u64 [R][E_l],
                         // (sender's tokens << 48) | (count << 32) | seq
  long long send;        // byte offset of half 0's send area (dispatch slots [destination][token] for puts);
                         // half 1's follows it, `dispatch`'s size later
};

struct Common {
  int rank, num_ranks;
  int max_tokens, hidden, num_experts;
  unsigned spec_check;            // hash of what ranks must agree on
  int system_scope;               // peers on other GPUs: order at system scope, else at GPU scope
  int gpu_share;                  // ranks whose kernels run on this GPU at the same time (this one included)
  long long peer_bases[kMaxRanks];  // each rank's buffer, mapped here (kernel parameters: no global load); for a
                                  // rank in put_ranks, this rank's own buffer (its symmetric address)
  // Ranks reached through NVSHMEM puts rather than by loads and stores (bit r; ep_layer._C_nvshmem only: a
  // peer without a load/store path, or every rank when puts are forced).
  unsigned put_ranks;
  unsigned char* local_base;      // this rank's buffer
  BufferOffsets layout;
  unsigned* ticket;               // per call: the sequence number its send half used
  volatile int* host_error;       // host-mapped flag: set when error is recorded
  unsigned long long timeout_ns;
  // Latency histogram, owned by the backend: [2 Ops][num bounds + 2], per Op the calls per bucket (the
  // number of bounds below the latency; the last one is +Inf), then their sum in ns. The bounds are in
  // __constant__ memory (set_latency_bounds, from ep_layer/latency.py).
  unsigned long long* latency;
  // Rank masking (Buffer(enable_shrink=True)): int [num_ranks] in device memory, 1 = masked (nothing is
  // sent to it or waited for from it; a peer that misses a wait is masked instead of failing the call).
  // Null when masking is off.
  int* mask;
};
constexpr int kMaxLatencyBounds = 32;  // size of the __constant__ table of bounds

#ifdef __CUDACC__  // device helpers; the host-only bindings see just the structs above
// ---------------------------------------------------------------- memory ordering for peer memory
// Flags that guard data are polled with acquire loads (a fence after a relaxed poll would also wait for
// this thread's earlier stores); data is published by a release store of its flag after a block/warp
// barrier (release is cumulative over the barrier). Other threads of the poller's warp or block read
// the data after a barrier with the poller.
// The scope is the GPU when every rank shares this device (emulated ranks, processes on one GPU),
// the system when peers sit on other GPUs; system-scope ordering costs microseconds, so only then.
// `c` is any call state with a `system_scope` field (Common, NormalCommon).
template <typename Scope>
__device__ __forceinline__ unsigned ld_relaxed(const Scope& c, const unsigned* p) {
  unsigned v;
  if (c.system_scope) asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <typename Scope>
__device__ __forceinline__ unsigned long long ld_relaxed(const Scope& c, const unsigned long long* p) {
  unsigned long long v;
  if (c.system_scope) asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
template <typename Scope>
__device__ __forceinline__ unsigned ld_acquire(const Scope& c, const unsigned* p) {
  unsigned v;
  if (c.system_scope) asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <typename Scope>
__device__ __forceinline__ unsigned long long ld_acquire(const Scope& c, const unsigned long long* p) {
  unsigned long long v;
  if (c.system_scope) asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
template <typename Scope>
__device__ __forceinline__ void st_release(const Scope& c, unsigned* p, unsigned v) {
  if (c.system_scope) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
template <typename Scope>
__device__ __forceinline__ void st_release(const Scope& c, unsigned long long* p, unsigned long long v) {
  if (c.system_scope) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The clock of a bounded wait: the nanoseconds its thread spent polling, leaving out any pause longer than
// kWaitPauseNs between two of its reads, when the thread's context was switched out (the GPU time-slices between
// processes, or tears a dead one down): a peer is timed only while the waiter could have seen it arrive, and a
// waiter switched out past the deadline polls again before it gives up.
constexpr unsigned long long kWaitPauseNs = 1000000;
struct WaitClock {
  unsigned long long last, spent = 0;
  __device__ __forceinline__ WaitClock() : last(globaltimer()) {}
  __device__ __forceinline__ bool expired(unsigned long long timeout_ns) {
    const unsigned long long now = globaltimer(), step = now - last;
    last = now;
    if (step < kWaitPauseNs) spent += step;
    return spent > timeout_ns;
  }
};

__device__ __forceinline__ bool first_block() { return blockIdx.x == 0 && blockIdx.y == 0; }

// Called by one thread of every block of a launch that starts a call: this call's sequence number
// (one past the last call's; its parity picks the buffer half), from the launch counter `launches`.
// See kLaunchShift.
__device__ __forceinline__ unsigned take_ticket(unsigned long long* launches) {
  const unsigned long long blocks = gridDim.x * gridDim.y;
  const unsigned long long add = first_block() ? (1ull << kLaunchShift) - (blocks - 1) : 1ull;
  return static_cast<unsigned>(atomicAdd(launches, add) >> kLaunchShift) + 1u;
}

__device__ __forceinline__ unsigned take_ticket(const Common& c, Op op) {
  return take_ticket(&reinterpret_cast<Control*>(c.local_base)->launches[op]);
}

// Bucket bounds of the latency histogram (ascending ns), set by set_latency_bounds. Internal linkage:
// each kernel file has its own copy (set_dispatch_latency_bounds / set_combine_latency_bounds).
static __constant__ unsigned long long g_latency_bounds_ns[kMaxLatencyBounds];
static __constant__ int g_num_latency_bounds;

static inline cudaError_t set_latency_bounds_of_this_file(const unsigned long long* ns, int n) {
  const cudaError_t err = cudaMemcpyToSymbol(g_latency_bounds_ns, ns, sizeof(unsigned long long) * n);
  return err != cudaSuccess ? err : cudaMemcpyToSymbol(g_num_latency_bounds, &n, sizeof(int));
}

__device__ __forceinline__ unsigned long long span(unsigned long long from, unsigned long long to) {
  return to > from ? to - from : 0ull;
}

__device__ __forceinline__ void red_max(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ TimingRecord& timing_record(const Common& c, Op op, unsigned seq) {
  return reinterpret_cast<Control*>(c.local_base)->timing[op].call[seq % kTimingRecords];
}

// Shared memory of a send kernel's block 0: the record of the call two before this one, fetched at the
// start and added to the histogram at the end.
struct alignas(16) SendTiming {
  TimingRecord previous;
};

// Thread 0 of block 0 of a kernel that starts a call, once it has the call's sequence number: fetch the
// record of call seq - 2 into shared memory without waiting for it (cp.async: no register holds it
// through the kernel), and start this call's record. `fused`: one kernel does both halves, so its span
// counts as the receive span (the send span is empty).
__device__ __forceinline__ void begin_call_timing(const Common& c, Op op, unsigned seq, unsigned long long start,
                                                  bool fused, SendTiming& s) {
  const auto* src = reinterpret_cast<const unsigned char*>(&timing_record(c, op, seq - 2u));
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(&s.previous));
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;\n\t"
      "cp.async.cg.shared.global [%2], [%3], 16;\n\t"
      "cp.async.commit_group;" ::"r"(dst), "l"(src), "r"(dst + 16), "l"(src + 16) : "memory");
  TimingRecord& rec = timing_record(c, op, seq);
  rec.send_start = start;
  if (fused) rec.send_end = start;
  rec.recv_start = fused ? ~start : 0ull;  // a hook's receive notes its own start later
}

// Thread 0 of block 0, when its work is done: add call seq - 2 to the histogram if its receive ran. Here
// rather than at the start: by now the copy has arrived, so nothing waits for global memory, and what is
// left (the bounds from the constant cache, two fire-and-forget atomics) delays only block 0's exit.
__device__ __forceinline__ void account_previous_call(const Common& c, Op op, SendTiming& s) {
  asm volatile("cp.async.wait_all;" ::: "memory");
  const TimingRecord old = s.previous;
  if (old.recv_start == 0) return;  // never received (or no such call)
  const unsigned long long ns = span(old.send_start, old.send_end) + span(~old.recv_start, old.recv_end);
  const int n = g_num_latency_bounds;
  int bucket = 0;  // bounds below ns: ep_layer.latency.bucket_of
#pragma unroll
  for (int i = 0; i < kMaxLatencyBounds; ++i) bucket += i < n && ns > g_latency_bounds_ns[i];
  unsigned long long* row = c.latency + static_cast<int>(op) * (n + 2);
  red_add(row + bucket, 1ull);
  red_add(row + n + 1, ns);
}

// Called by thread 0 of every block at the end of a send kernel (after the block's work).
__device__ __forceinline__ void finish_send(const Common& c, Op op, unsigned seq, SendTiming& s) {
  red_max(&timing_record(c, op, seq).send_end, globaltimer());
  if (first_block()) account_previous_call(c, op, s);
}

// Receive kernels: block 0 notes the kernel's start (one store; it starts with the first wave), and
// thread 0 of every block its block's end after the block's work, with one fire-and-forget atomic (RED:
// nothing waits for it, no fence, no block counter). No RED from every block at the start as well: they
// queue on one address and slow the combine (benchmarks/RESULTS.md, tried and not kept). The start is kept
// inverted so that 0 means "none yet".
__device__ __forceinline__ void mark_recv_start(const Common& c, Op op, unsigned seq, unsigned long long now) {
  if (first_block() && threadIdx.x == 0) timing_record(c, op, seq).recv_start = ~now;
}

// Called by every thread of every block at the end of a receive kernel (after the block's work).
__device__ __forceinline__ void finish_recv(const Common& c, Op op, unsigned seq) {
  __syncthreads();  // thread 0 notes the end once the whole block is done
  if (threadIdx.x == 0) red_max(&timing_record(c, op, seq).recv_end, globaltimer());
}

// Records the first failure in `error` (later ones add their ranks) and raises the host-mapped flag.
__device__ __forceinline__ void record_error(ErrorRecord& error, volatile int* host_error, int op, int code,
                                             unsigned ranks, int detail = 0) {
  if (atomicCAS(&error.code, 0, code) == 0) {
    error.op = op;
    error.detail = detail;
  }
  atomicOr(&error.ranks, ranks);
  __threadfence_system();
  *host_error = 1;
}

__device__ __forceinline__ void record_error(const Common& c, Op op, ErrorCode code, unsigned ranks,
                                             int detail = 0) {
  record_error(reinterpret_cast<Control*>(c.local_base)->error, c.host_error, op, code, ranks, detail);
}

// Rank masking: whether this rank has masked `rank` (never itself). Read on every use: another block
// of the same call may mask a peer while this one waits for it.
__device__ __forceinline__ bool is_masked(const Common& c, int rank) {
  return c.mask != nullptr && rank != c.rank && ld_relaxed(c, reinterpret_cast<const unsigned*>(c.mask + rank)) != 0;
}

// The ranks masked when a block starts, as bits: a send skips them for the whole call.
__device__ __forceinline__ unsigned masked_ranks(const Common& c) {
  unsigned bits = 0;
  if (c.mask != nullptr)
    for (int r = 0; r < c.num_ranks; ++r) bits |= static_cast<unsigned>(is_masked(c, r)) << r;
  return bits;
}

// A peer missed a wait: with masking it is masked from now on and the caller carries on without it
// (returns true); otherwise the timeout is recorded, naming it (returns false).
__device__ __forceinline__ bool peer_missed(const Common& c, Op op, int rank) {
  if (c.mask != nullptr) {
    atomicExch(c.mask + rank, 1);
    return true;
  }
  record_error(c, op, kTimeout, 1u << rank);
  return false;
}

__device__ __forceinline__ unsigned char* half_base(const Common& c, long long base, unsigned seq) {
  return reinterpret_cast<unsigned char*>(base) + c.layout.control + (seq & 1u) * c.layout.half;
}

// A mask of ranks reached through NVSHMEM as it is in the NVSHMEM build, and none in ep_layer._C, where the
// NVSHMEM branches then compile away.
__device__ __forceinline__ unsigned nvshmem_only(unsigned ranks) {
#ifdef EP_LAYER_NVSHMEM
  return ranks;
#else
  return ranks & 0u;
#endif
}

// The ranks reached through NVSHMEM puts (bits).
__device__ __forceinline__ unsigned put_mask(const Common& c) { return nvshmem_only(c.put_ranks); }

__device__ __forceinline__ bool by_put(const Common& c, int r) { return (put_mask(c) >> r) & 1u; }

// Stores a word that orders no data (a hello, a tagged count) at `p` of rank r's buffer: a plain store
// through its mapping, or an NVSHMEM signal (an atomic 64-bit write) at that symmetric address.
__device__ __forceinline__ void store_word(const Common& c, int r, unsigned long long* p, unsigned long long v) {
#ifdef EP_LAYER_NVSHMEM
  if (by_put(c, r)) {
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(p), v, NVSHMEM_SIGNAL_SET, r);
    return;
  }
#endif
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

#ifdef EP_LAYER_NVSHMEM
// The calling warp puts `bytes` from `src` (this rank's buffer) to `dst` (a symmetric address) of rank r,
// then sets the flag `*flag` = v there, after the data (NVSHMEM orders a put's signal after its data). It
// returns once `src` may be reused.
__device__ __forceinline__ void put_with_flag(int r, void* dst, const void* src, size_t bytes, unsigned long long* flag,
                                              unsigned long long v) {
  nvshmemx_putmem_signal_warp(dst, src, bytes, reinterpret_cast<uint64_t*>(flag), v, NVSHMEM_SIGNAL_SET, r);
}
#endif

// Announce this call to every peer; thread r < num_ranks writes to rank r. A plain (relaxed) store: a
// hello orders no data (every piece of data has its own flag); it tells peers what this rank agreed
// to and that its kernels for this call have started.
__device__ __forceinline__ void say_hello(const Common& c, Op op, unsigned seq) {
  if (threadIdx.x < c.num_ranks && !is_masked(c, threadIdx.x)) {
    auto* peer = reinterpret_cast<Control*>(c.peer_bases[threadIdx.x]);
    store_word(c, threadIdx.x, &peer->hello[op][seq & 1u][c.rank],
               (static_cast<unsigned long long>(c.spec_check) << 32) | seq);
  }
}

constexpr unsigned long long kNeverArrived = ~0ull;

// Polls a flag written by rank `peer` whose low 32 bits become `seq`; returns the nanoseconds waited (0
// if it was already there; the clock is only read once the first poll fails), or kNeverArrived after
// the timeout or once `peer` is masked. `acquire`: poll with acquire loads so that the data published
// before the flag is visible (a flag that guards no data, such as a hello, does without).
template <typename Word>
__device__ __forceinline__ unsigned long long wait_for(const Common& c, const Word* flag, unsigned seq, int peer,
                                                       Word* value = nullptr, bool acquire = true) {
  Word v = acquire ? ld_acquire(c, flag) : ld_relaxed(c, flag);
  unsigned long long waited = 0;
  if (static_cast<unsigned>(v) != seq) {
    const unsigned long long start = globaltimer();
    WaitClock clock;
    while (static_cast<unsigned>(v = acquire ? ld_acquire(c, flag) : ld_relaxed(c, flag)) != seq) {
      if (clock.expired(c.timeout_ns) || is_masked(c, peer)) {
        waited = kNeverArrived;
        break;
      }
    }
    if (waited != kNeverArrived) waited = globaltimer() - start;
  }
  if (value) *value = v;
  return waited;
}

// Waits for rank `source`'s hello of this call; false (with the reason recorded) if it never came or
// the rank disagrees on what it was called with. A masked rank (or, with masking, one that never came)
// is left out: true.
__device__ __forceinline__ bool hello_agrees(const Common& c, Op op, unsigned seq, int source) {
  if (is_masked(c, source)) return true;
  const auto* ctrl = reinterpret_cast<const Control*>(c.local_base);
  unsigned long long v;
  if (wait_for(c, &ctrl->hello[op][seq & 1u][source], seq, source, &v, /*acquire=*/false) == kNeverArrived)
    return peer_missed(c, op, source);
  if (static_cast<unsigned>(v >> 32) != c.spec_check) {
    record_error(c, op, kMismatch, 1u << source);
    return false;
  }
  return true;
}

// Threads r < num_ranks wait for rank r's hello; returns false (and records why) if any failed.
// Must be called by all threads of the block.
__device__ __forceinline__ bool check_hellos(const Common& c, Op op, unsigned seq) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < c.num_ranks && !hello_agrees(c, op, seq, threadIdx.x)) failed = 1;
  __syncthreads();
  return failed == 0;
}

// 16-byte load that skips L1: the data was written by a peer after this SM may have cached the line.
__device__ __forceinline__ int4 ld_peer_written(const void* p) {
  return __ldcg(reinterpret_cast<const int4*>(p));
}

// An L2 policy for data read once: its lines go first when L2 needs room.
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// ld_peer_written under an L2 policy (evict_first_policy: a stream read once should not push out of L2
// what kernels running beside it reuse, such as the expert GEMM's rows and weight tiles).
__device__ __forceinline__ int4 ld_peer_written(const void* p, unsigned long long policy) {
  int4 v;
  asm volatile("ld.global.cg.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// Copies n 16-byte vectors, thread `first` of `stride` threads taking every stride-th one, with
// kCopyBatch loads in flight per thread: a copy loop that waits on each load is latency-bound.
constexpr int kCopyBatch = 8;
__device__ __forceinline__ void copy_vectors(int4* dst, const int4* src, int n, int first, int stride) {
  for (int base = first; base < n; base += stride * kCopyBatch) {
    int4 r[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u)
      if (base + u * stride < n) r[u] = ld_peer_written(src + base + u * stride);
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u)
      if (base + u * stride < n) dst[base + u * stride] = r[u];
  }
}

#endif  // __CUDACC__

// ---------------------------------------------------------------- launchers (host side)
struct DispatchCall {
  Common c;
  int num_tokens, num_topk;
  int use_fp8, round_scale, use_ue8m0;
  int chunks_per_slot;           // receive-half work items per slot (channel chunks)
  const __nv_bfloat16* x;
  const long long* topk_idx;
  void* recv_x;                  // bf16 or fp8 [E_l, R*T, H], or null with recv_rows
  long long* recv_rows;          // [E_l, R*T] or null: rows in place, each row's payload as a byte offset
                                 // from this rank's buffer (nothing is copied into recv_x)
  void* recv_scales;             // float [E_l, G, R*T] or int [E_l, G/4, R*T] (column-major view)
  int* recv_count;               // [E_l]
  int* src_info;                 // [E_l, R*T]
  long long* layout_range;       // [E_l, R]
  int* combine_map;              // [E_l, R*T]: (top-k position mask << 13) | (source rank * T + token)
  int* recv_stats;               // [E_l] or null
  long long* wait_stats;         // [R] or null
};

struct CombineCall {
  Common c;
  int num_tokens, num_topk;
  int blocks_per_expert;
  const __nv_bfloat16* x;        // [E_l, R*T, H] expert outputs
  long long x_row;               // x's first row as a row of this rank's buffer (peers pull from it), or -1
  long long stage_row;           // with put ranks: the first row of a bf16 [E_l, R*T, H] area of this rank's
                                 // buffer that rows are put from (copied there unless x is that area), or -1
  const int* recv_count;         // [E_l], from dispatch
  const int* combine_map;        // [E_l, R*T], from dispatch
  const long long* topk_idx;     // [N, K]
  const float* topk_weights;     // [N, K]
  __nv_bfloat16* out;            // [N, H]
  long long* wait_stats;         // [R] or null
  // Single-batch overlap (DeepEP forks' overlap=True): x is still being written by the expert GEMM, and row m
  // of local expert l is sent once signals[l * signals_per_expert + m / signal_rows] >= signal_threshold.
  const int* signals;            // null: x is complete when the send starts (stream order)
  int signal_rows, signals_per_expert, signal_threshold;
  int send_sms;                  // at most this many send blocks (0: one per expert and row group)
};

void dispatch_send(const DispatchCall& call, cudaStream_t stream);
void dispatch_recv(const DispatchCall& call, cudaStream_t stream);
// Both halves in one kernel (no hook).
void dispatch_fused(const DispatchCall& call, cudaStream_t stream);
void combine_send(const CombineCall& call, cudaStream_t stream);
void combine_recv(const CombineCall& call, cudaStream_t stream);
// Both halves in one kernel (no hook).
void combine_fused(const CombineCall& call, cudaStream_t stream);
// Copy the latency bounds (ascending ns, n <= kMaxLatencyBounds) into each kernel file's __constant__
// table on the current device (runtime.cu: set_latency_bounds).
cudaError_t set_dispatch_latency_bounds(const unsigned long long* ns, int n);
cudaError_t set_combine_latency_bounds(const unsigned long long* ns, int n);

}  // namespace ep
