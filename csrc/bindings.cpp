// pybind11 module ep_layer._C: named structs of sizes, tuples of device pointers (as ints) in the order of
// names it exports, and the CUDA stream, in; no libtorch ABI involved.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include <stdexcept>
#include <string>
#include <vector>

#include "normal.cuh"
#include "runtime.h"
#ifdef EP_LAYER_NVSHMEM
#include "nvshmem_glue.h"
#endif

// The module's name: _C, or _C_nvshmem for the build whose kernels also reach peers by NVSHMEM puts.
#ifndef EP_LAYER_MODULE
#define EP_LAYER_MODULE _C
#endif

namespace py = pybind11;

// Variadic: __CUDA_ARCH_LIST__ of a several-arch build is a comma list ("800,900").
#define EP_STRINGIFY_(...) #__VA_ARGS__
#define EP_STRINGIFY(...) EP_STRINGIFY_(__VA_ARGS__)
using ep::Common;

namespace {

template <typename T>
T* ptr(long long p) {
  return reinterpret_cast<T*>(p);
}

// One field of a plain struct, by the name Python gives it.
template <typename T, typename M>
struct Field {
  const char* name;
  M T::*member;
};

template <typename T, typename M>
Field<T, M> field(const char* name, M T::*member) {
  return {name, member};
}

// Binds plain struct T with a keyword-only constructor that takes every field by its name (a value cannot
// land in the wrong field, and none can be left out) and a read-only attribute per field.
template <typename T, typename... M>
void bind_struct(py::module_& m, const char* name, Field<T, M>... fields) {
  py::class_<T> cls(m, name, py::module_local());  // module-local: _C and _C_nvshmem bind the same types
  cls.def(py::init([fields...](M... values) {
            T t{};
            ((t.*fields.member = values), ...);
            return t;
          }),
          py::kw_only(), py::arg(fields.name)...);
  (cls.def_readonly(fields.name, fields.member), ...);
}

// What a rank's Common is made of: its place among the ranks, the shape they agree on, its buffers.
struct CommonArgs {
  int rank, num_ranks, max_tokens, hidden, num_experts;
  unsigned spec_check;  // hash of what ranks must agree on
  bool system_scope;
  int gpu_share;
  std::vector<long long> peer_bases;
  long long local_base;
  ep::BufferOffsets layout;
  long long host_error;  // device pointer of the host-mapped error flag
  double timeout_s;
  long long latency;  // the latency histogram (ll_common.cuh: Common::latency)
  long long mask;     // rank masking's int [num_ranks], or 0 when masking is off
  unsigned put_ranks;  // ranks reached through NVSHMEM puts (bit r); 0 in the build without NVSHMEM
};

Common make_common(const CommonArgs& a) {
  if (a.gpu_share < 1 || a.gpu_share > a.num_ranks)
    throw std::invalid_argument("make_common: gpu_share must be in [1, num_ranks]");
  if (a.peer_bases.size() != static_cast<size_t>(a.num_ranks) || a.num_ranks > ep::kMaxRanks)
    throw std::invalid_argument("make_common: one buffer per rank, at most " + std::to_string(ep::kMaxRanks));
  Common c{};
  c.rank = a.rank;
  c.num_ranks = a.num_ranks;
  c.max_tokens = a.max_tokens;
  c.hidden = a.hidden;
  c.num_experts = a.num_experts;
  c.spec_check = a.spec_check;
  c.system_scope = a.system_scope;
  c.gpu_share = a.gpu_share;
  for (int r = 0; r < a.num_ranks; ++r) c.peer_bases[r] = a.peer_bases[r];
  c.local_base = ptr<unsigned char>(a.local_base);
  c.layout = a.layout;
  c.host_error = ptr<volatile int>(a.host_error);
  c.timeout_ns = static_cast<unsigned long long>(a.timeout_s * 1e9);
  c.latency = ptr<unsigned long long>(a.latency);
  c.mask = ptr<int>(a.mask);
#ifndef EP_LAYER_NVSHMEM
  if (a.put_ranks != 0)
    throw std::invalid_argument("make_common: put_ranks needs the NVSHMEM build of the kernels (ep_layer._C_nvshmem)");
#endif
  c.put_ranks = a.put_ranks;
  return c;
}

// A dispatch call's sizes and flags (ll_common.cuh: DispatchCall, the same names), the same from call to
// call of one shape: the caller keeps one per shape.
struct DispatchShape {
  int num_tokens, num_topk;
  bool use_fp8, round_scale, use_ue8m0;
  int chunks_per_slot;
};

// The device pointers of a call's output set (as ints, 0 = none) arrive once, as one tuple in the order of
// these names, when the call is prepared; Python builds it from a NamedTuple of the same field names, and
// ep_layer/native.py checks at load that both orders agree. The caller's own tensors change from call to call
// and come with each launch.
enum DispatchPointer {
  kDispatchTicket, kRecvX, kRecvScales, kRecvRows, kRecvCount, kSrcInfo, kLayoutRange, kDispatchCombineMap,
  kNumDispatchPointers
};
const char* const kDispatchPointerNames[kNumDispatchPointers] = {
    "ticket", "recv_x", "recv_scales", "recv_rows", "recv_count", "src_info", "layout_range", "combine_map"};
using DispatchPointers = std::array<long long, kNumDispatchPointers>;

// A dispatch of one shape into one output set, whole but for the caller's tensors: a launch copies it and
// fills in those four addresses, so that a call converts a few ints instead of every field (host time).
struct PreparedDispatch {
  ep::DispatchCall call;
};

PreparedDispatch prepare_dispatch(const Common& common, const DispatchShape& s, const DispatchPointers& p) {
  ep::DispatchCall call{};
  call.c = common;
  call.c.ticket = ptr<unsigned>(p[kDispatchTicket]);
  call.num_tokens = s.num_tokens;
  call.num_topk = s.num_topk;
  call.use_fp8 = s.use_fp8;
  call.round_scale = s.round_scale;
  call.use_ue8m0 = s.use_ue8m0;
  call.chunks_per_slot = s.chunks_per_slot;
  call.recv_x = ptr<void>(p[kRecvX]);
  call.recv_scales = ptr<void>(p[kRecvScales]);
  call.recv_rows = ptr<long long>(p[kRecvRows]);
  call.recv_count = ptr<int>(p[kRecvCount]);
  call.src_info = ptr<int>(p[kSrcInfo]);
  call.layout_range = ptr<long long>(p[kLayoutRange]);
  call.combine_map = ptr<int>(p[kDispatchCombineMap]);
  return {call};
}

// A combine call's sizes (ll_common.cuh: CombineCall, the same names), kept per shape as DispatchShape.
struct CombineShape {
  int num_tokens, num_topk, blocks_per_expert;
};

// What a combine reads from its dispatch's output set, named as DispatchPointers are.
enum CombinePointer { kCombineTicket, kCombineRecvCount, kCombineMap, kNumCombinePointers };
const char* const kCombinePointerNames[kNumCombinePointers] = {"ticket", "recv_count", "combine_map"};
using CombinePointers = std::array<long long, kNumCombinePointers>;

// Single-batch overlap and the send's SM cap (ll_common.cuh: CombineCall's signals ... send_sms, the same
// names); a launch without them passes None.
struct CombineOverlap {
  long long signals;
  int signal_rows, signals_per_expert, signal_threshold, send_sms;
};

// A combine of one shape for one dispatch's output set, prepared as PreparedDispatch is.
struct PreparedCombine {
  ep::CombineCall call;
};

PreparedCombine prepare_combine(const Common& common, const CombineShape& s, const CombinePointers& p) {
  ep::CombineCall call{};
  call.c = common;
  call.c.ticket = ptr<unsigned>(p[kCombineTicket]);
  call.num_tokens = s.num_tokens;
  call.num_topk = s.num_topk;
  call.blocks_per_expert = s.blocks_per_expert;
  call.recv_count = ptr<const int>(p[kCombineRecvCount]);
  call.combine_map = ptr<const int>(p[kCombineMap]);
  return {call};
}

template <size_t N>
py::tuple names(const char* const (&list)[N]) {
  py::tuple t(N);
  for (size_t i = 0; i < N; ++i) t[i] = py::str(list[i]);
  return t;
}

// Launches `call` on `stream` with one of ep's launchers; a failed launch raises, naming `kernel`.
template <typename Call>
void launch(void (*launcher)(const Call&, cudaStream_t), const Call& call, long long stream, const char* kernel) {
  launcher(call, ptr<CUstream_st>(stream));
  ep::check_launch(kernel);
}

void bind_arguments(py::module_& m) {
  using ep::BufferOffsets;
  bind_struct(m, "BufferOffsets", field("control", &BufferOffsets::control), field("half", &BufferOffsets::half),
              field("dispatch", &BufferOffsets::dispatch), field("slot", &BufferOffsets::slot),
              field("combine", &BufferOffsets::combine), field("flags", &BufferOffsets::flags),
              field("counts", &BufferOffsets::counts), field("send", &BufferOffsets::send));
  bind_struct(m, "CommonArgs", field("rank", &CommonArgs::rank), field("num_ranks", &CommonArgs::num_ranks),
              field("max_tokens", &CommonArgs::max_tokens), field("hidden", &CommonArgs::hidden),
              field("num_experts", &CommonArgs::num_experts), field("spec_check", &CommonArgs::spec_check),
              field("system_scope", &CommonArgs::system_scope), field("gpu_share", &CommonArgs::gpu_share),
              field("peer_bases", &CommonArgs::peer_bases), field("local_base", &CommonArgs::local_base),
              field("layout", &CommonArgs::layout), field("host_error", &CommonArgs::host_error),
              field("timeout_s", &CommonArgs::timeout_s), field("latency", &CommonArgs::latency),
              field("mask", &CommonArgs::mask), field("put_ranks", &CommonArgs::put_ranks));
  bind_struct(m, "DispatchShape", field("num_tokens", &DispatchShape::num_tokens),
              field("num_topk", &DispatchShape::num_topk), field("use_fp8", &DispatchShape::use_fp8),
              field("round_scale", &DispatchShape::round_scale), field("use_ue8m0", &DispatchShape::use_ue8m0),
              field("chunks_per_slot", &DispatchShape::chunks_per_slot));
  bind_struct(m, "CombineShape", field("num_tokens", &CombineShape::num_tokens),
              field("num_topk", &CombineShape::num_topk), field("blocks_per_expert", &CombineShape::blocks_per_expert));
  bind_struct(m, "CombineOverlap", field("signals", &CombineOverlap::signals),
              field("signal_rows", &CombineOverlap::signal_rows),
              field("signals_per_expert", &CombineOverlap::signals_per_expert),
              field("signal_threshold", &CombineOverlap::signal_threshold),
              field("send_sms", &CombineOverlap::send_sms));
  m.attr("DISPATCH_POINTERS") = names(kDispatchPointerNames);
  m.attr("COMBINE_POINTERS") = names(kCombinePointerNames);
}

// Binds one kernel of the dispatch: a launch of a prepared dispatch with the caller's tensors.
void def_dispatch_launcher(py::module_& m, const char* name, void (*launcher)(const ep::DispatchCall&, cudaStream_t),
                           const char* kernel) {
  m.def(
      name,
      [launcher, kernel](const PreparedDispatch& prepared, long long x, long long topk_idx, long long recv_stats,
                         long long wait_stats, long long stream) {
        ep::DispatchCall call = prepared.call;
        call.x = ptr<const __nv_bfloat16>(x);
        call.topk_idx = ptr<const long long>(topk_idx);
        call.recv_stats = ptr<int>(recv_stats);
        call.wait_stats = ptr<long long>(wait_stats);
        launch(launcher, call, stream, kernel);
      },
      py::arg("prepared"), py::arg("x"), py::arg("topk_idx"), py::arg("recv_stats"), py::arg("wait_stats"),
      py::arg("stream"));
}

// Binds one kernel of the combine, as def_dispatch_launcher does. x_row and stage_row are row indices or -1
// (ll_common.cuh: CombineCall); overlap is None or a CombineOverlap.
void def_combine_launcher(py::module_& m, const char* name, void (*launcher)(const ep::CombineCall&, cudaStream_t),
                          const char* kernel) {
  m.def(
      name,
      [launcher, kernel](const PreparedCombine& prepared, long long x, long long x_row, long long stage_row,
                         long long topk_idx, long long topk_weights, long long out, long long wait_stats,
                         const CombineOverlap* overlap, long long stream) {
        ep::CombineCall call = prepared.call;
        call.x = ptr<const __nv_bfloat16>(x);
        call.x_row = x_row;
        call.stage_row = stage_row;
        call.topk_idx = ptr<const long long>(topk_idx);
        call.topk_weights = ptr<const float>(topk_weights);
        call.out = ptr<__nv_bfloat16>(out);
        call.wait_stats = ptr<long long>(wait_stats);
        if (overlap != nullptr) {
          call.signals = ptr<const int>(overlap->signals);
          call.signal_rows = overlap->signal_rows;
          call.signals_per_expert = overlap->signals_per_expert;
          call.signal_threshold = overlap->signal_threshold;
          call.send_sms = overlap->send_sms;
        }
        launch(launcher, call, stream, kernel);
      },
      py::arg("prepared"), py::arg("x"), py::arg("x_row"), py::arg("stage_row"), py::arg("topk_idx"),
      py::arg("topk_weights"), py::arg("out"), py::arg("wait_stats"), py::arg("overlap").none(true),
      py::arg("stream"));
}

// A call runs its send half and its receive half (the hook) as two kernels, or both as one.
void bind_launchers(py::module_& m) {
  py::class_<PreparedDispatch>(m, "PreparedDispatch", py::module_local());
  py::class_<PreparedCombine>(m, "PreparedCombine", py::module_local());
  m.def("prepare_dispatch", &prepare_dispatch, py::arg("common"), py::arg("shape"), py::arg("pointers"));
  m.def("prepare_combine", &prepare_combine, py::arg("common"), py::arg("shape"), py::arg("pointers"));
  def_dispatch_launcher(m, "dispatch_send", ep::dispatch_send, "dispatch send kernel");
  def_dispatch_launcher(m, "dispatch_receive", ep::dispatch_recv, "dispatch receive kernel");
  def_dispatch_launcher(m, "dispatch_both_halves", ep::dispatch_fused, "dispatch kernel");
  def_combine_launcher(m, "combine_send", ep::combine_send, "combine send kernel");
  def_combine_launcher(m, "combine_receive", ep::combine_recv, "combine receive kernel");
  def_combine_launcher(m, "combine_both_halves", ep::combine_fused, "combine kernel");
}

// ---------------------------------------------------------------- normal (high-throughput) mode
struct NormalCommonArgs {
  int rank, num_ranks;
  bool system_scope;
  std::vector<long long> peer_bases;
  long long local_base, half_bytes;
  long long host_error;  // device pointer of the host-mapped error flag
  double timeout_s;
  long long ticket;      // device unsigned: the sequence number of the call in flight
  unsigned get_ranks;    // ranks read with NVSHMEM gets (ep_layer._C_nvshmem only)
  long long landing;     // this rank's landing area (NORMAL_LANDING_BYTES on the NVSHMEM heap), 0 without get ranks
};

ep::NormalCommon make_normal_common(const NormalCommonArgs& a) {
  if (a.peer_bases.size() != static_cast<size_t>(a.num_ranks) || a.num_ranks > ep::kMaxRanks)
    throw std::invalid_argument("make_normal_common: one buffer per rank, at most " + std::to_string(ep::kMaxRanks));
  if (a.half_bytes <= ep::kStageHeaderBytes || a.half_bytes % 128 != 0)
    throw std::invalid_argument("make_normal_common: half_bytes must be a multiple of 128 above the header");
  ep::NormalCommon c{};
  c.rank = a.rank;
  c.num_ranks = a.num_ranks;
  c.system_scope = a.system_scope;
  for (int r = 0; r < a.num_ranks; ++r) c.peer_bases[r] = a.peer_bases[r];
  c.local_base = ptr<unsigned char>(a.local_base);
  c.half_bytes = a.half_bytes;
  c.host_error = ptr<volatile int>(a.host_error);
  c.timeout_ns = static_cast<unsigned long long>(a.timeout_s * 1e9);
  c.ticket = ptr<unsigned>(a.ticket);
#ifndef EP_LAYER_NVSHMEM
  if (a.get_ranks != 0) throw std::invalid_argument("make_normal_common: get_ranks needs ep_layer._C_nvshmem");
#endif
  if (a.get_ranks != 0 && a.landing == 0) throw std::invalid_argument("make_normal_common: get ranks need a landing area");
  c.get_ranks = a.get_ranks;
  c.landing = ptr<unsigned char>(a.landing);
  return c;
}

// A normal call's sizes (ep::NormalCall's int fields, the same names).
struct NormalShape {
  int op, num_rows, x_bytes, scale_bytes, num_topk;
  bool has_idx, has_weights;
  int num_experts, out_rows, num_tokens;
  bool rows_in_place;
};

enum NormalPointer {
  kNX, kNScales, kNTopkIdx, kNTopkWeights, kNInRank, kNRowsToRank, kNTokensPerExpert, kNMeta, kNRankPrefix,
  kNExpectedPrefix, kNSrcIdx, kNSrcRank, kNOutX, kNOutScales, kNOutTopkIdx, kNOutWeights, kNSendPos, kNOut,
  kNBias0, kNBias1, kNCombinedWeights, kNumNormalPointers
};
const char* const kNormalPointerNames[kNumNormalPointers] = {
    "x", "scales", "topk_idx", "topk_weights", "in_rank", "rows_to_rank", "tokens_per_expert", "meta",
    "rank_prefix", "expected_prefix", "src_idx", "src_rank", "out_x", "out_scales", "out_topk_idx", "out_weights",
    "send_pos", "out", "bias0", "bias1", "combined_weights"};
using NormalPointers = std::array<long long, kNumNormalPointers>;

ep::NormalCall normal_call(const NormalShape& s, const NormalPointers& p) {
  ep::NormalCall call{};
  call.op = s.op;
  call.num_rows = s.num_rows;
  call.x_bytes = s.x_bytes;
  call.scale_bytes = s.scale_bytes;
  call.num_topk = s.num_topk;
  call.has_idx = s.has_idx;
  call.has_weights = s.has_weights;
  call.num_experts = s.num_experts;
  call.out_rows = s.out_rows;
  call.num_tokens = s.num_tokens;
  call.rows_in_place = s.rows_in_place;
  call.x = ptr<const void>(p[kNX]);
  call.scales = ptr<const void>(p[kNScales]);
  call.topk_idx = ptr<const long long>(p[kNTopkIdx]);
  call.topk_weights = ptr<const float>(p[kNTopkWeights]);
  call.in_rank = ptr<const bool>(p[kNInRank]);
  call.rows_to_rank = ptr<const int>(p[kNRowsToRank]);
  call.tokens_per_expert = ptr<const int>(p[kNTokensPerExpert]);
  call.meta = ptr<int>(p[kNMeta]);
  call.rank_prefix = ptr<int>(p[kNRankPrefix]);
  call.expected_prefix = ptr<const int>(p[kNExpectedPrefix]);
  call.src_idx = ptr<int>(p[kNSrcIdx]);
  call.src_rank = ptr<int>(p[kNSrcRank]);
  call.out_x = ptr<void>(p[kNOutX]);
  call.out_scales = ptr<void>(p[kNOutScales]);
  call.out_topk_idx = ptr<long long>(p[kNOutTopkIdx]);
  call.out_weights = ptr<float>(p[kNOutWeights]);
  call.send_pos = ptr<const int>(p[kNSendPos]);
  call.out = ptr<__nv_bfloat16>(p[kNOut]);
  call.bias0 = ptr<const __nv_bfloat16>(p[kNBias0]);
  call.bias1 = ptr<const __nv_bfloat16>(p[kNBias1]);
  call.combined_weights = ptr<float>(p[kNCombinedWeights]);
  return call;
}

void bind_normal(py::module_& m) {
  py::class_<ep::NormalCommon>(m, "NormalCommon", py::module_local());
  bind_struct(m, "NormalCommonArgs", field("rank", &NormalCommonArgs::rank),
              field("num_ranks", &NormalCommonArgs::num_ranks), field("system_scope", &NormalCommonArgs::system_scope),
              field("peer_bases", &NormalCommonArgs::peer_bases), field("local_base", &NormalCommonArgs::local_base),
              field("half_bytes", &NormalCommonArgs::half_bytes), field("host_error", &NormalCommonArgs::host_error),
              field("timeout_s", &NormalCommonArgs::timeout_s), field("ticket", &NormalCommonArgs::ticket),
              field("get_ranks", &NormalCommonArgs::get_ranks), field("landing", &NormalCommonArgs::landing));
  m.def("make_normal_common", &make_normal_common);
  m.def("normal_load_kernels", [] { ep::check_cuda(ep::normal_load_kernels(), "loading the normal-mode kernels"); });
  bind_struct(m, "NormalShape", field("op", &NormalShape::op), field("num_rows", &NormalShape::num_rows),
              field("x_bytes", &NormalShape::x_bytes), field("scale_bytes", &NormalShape::scale_bytes),
              field("num_topk", &NormalShape::num_topk), field("has_idx", &NormalShape::has_idx),
              field("has_weights", &NormalShape::has_weights), field("num_experts", &NormalShape::num_experts),
              field("out_rows", &NormalShape::out_rows), field("num_tokens", &NormalShape::num_tokens),
              field("rows_in_place", &NormalShape::rows_in_place));
  m.attr("NORMAL_POINTERS") = names(kNormalPointerNames);
  using NC = const ep::NormalCommon&;
  using NS = const NormalShape&;
  using NP = const NormalPointers&;
  m.def("normal_stage", [](NC c, NS s, NP p, int num_sms, long long stream) {
    ep::normal_stage(c, normal_call(s, p), num_sms, ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode stage kernel");
  });
  m.def("normal_wait_combine_half", [](NC c, long long stream) {
    ep::normal_wait_combine_half(c, ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode wait kernel");
  });
  m.def("normal_exchange", [](NC c, NS s, NP p, long long stream) {
    ep::normal_exchange(c, normal_call(s, p), ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode exchange kernel");
  });
  m.def("normal_scan", [](NC c, NS s, NP p, long long stream) {
    ep::normal_scan(c, normal_call(s, p), ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode scan kernel");
  });
  m.def("normal_gather", [](NC c, NS s, NP p, int num_sms, long long stream) {
    ep::normal_gather(c, normal_call(s, p), num_sms, ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode gather kernel");
  });
  m.def("normal_reduce", [](NC c, NS s, NP p, int num_sms, long long stream) {
    ep::normal_reduce(c, normal_call(s, p), num_sms, ptr<CUstream_st>(stream));
    ep::check_launch("normal-mode reduce kernel");
  });
  m.attr("NORMAL_CONTROL_BYTES") = ep::kNormalControlBytes;
  m.attr("STAGE_HEADER_BYTES") = ep::kStageHeaderBytes;
  m.attr("NORMAL_LANDING_BYTES") = ep::kLandingBytes;
  m.attr("NORMAL_WARP_LANDING_BYTES") = ep::kWarpLandingBytes;
}

}  // namespace

PYBIND11_MODULE(EP_LAYER_MODULE, m) {
  m.doc() = "ep-layer CUDA kernels: low-latency dispatch/combine over peer memory (and NVSHMEM puts in _C_nvshmem)";
#ifdef EP_LAYER_NVSHMEM
  m.def("attach_nvshmem", &ep::attach_nvshmem);
  m.def("nvshmem_view", &ep::nvshmem_view);
#endif
  py::class_<Common>(m, "Common", py::module_local());
  bind_arguments(m);
  m.def("make_common", &make_common);
  bind_launchers(m);
  bind_normal(m);
  m.def("alloc_buffer", &ep::alloc_buffer);
  m.def("free_buffer", &ep::free_buffer);
  m.def("ipc_handle", [](long long p) { return py::bytes(ep::ipc_handle(p)); });
  m.def("ipc_open", [](py::bytes b) { return ep::ipc_open(std::string(b)); });
  m.def("ipc_close", &ep::ipc_close);
  m.def("alloc_host_flag", &ep::alloc_host_flag);
  m.def("free_host_flag", &ep::free_host_flag);
  m.def("read_host_flag", &ep::read_host_flag);
  m.def("clear_host_flag", &ep::clear_host_flag);
  m.def("read_error", &ep::read_error);
  m.def("clear_error", &ep::clear_error);
  m.def("set_latency_bounds", &ep::set_latency_bounds);
  m.def("read_timing", &ep::read_timing);
  m.def("memset_async", &ep::memset_async);
  m.def("create_stream", &ep::create_stream);
  m.def("num_sms", &ep::num_sms);
  m.attr("CONTROL_BYTES") = ep::kControlBytes;
  m.attr("MAX_RANKS") = ep::kMaxRanks;
  m.attr("MAX_TOPK") = ep::kMaxTopk;
  m.attr("MAX_EXPERTS") = ep::kMaxExperts;
  m.attr("DISPATCH_HEADER_BYTES") = ep::kHeaderBytes;
  m.attr("FP8_GROUP") = ep::kFp8Group;
  m.attr("FP8_MAX") = ep::kFp8Max;
  m.attr("AMAX_FLOOR") = ep::kAmaxFloor;
  m.attr("MAX_LATENCY_BOUNDS") = ep::kMaxLatencyBounds;
  m.attr("CUDA_ARCHS") = EP_STRINGIFY(__CUDA_ARCH_LIST__);  // e.g. "800,900": the GPU targets of this build
}
