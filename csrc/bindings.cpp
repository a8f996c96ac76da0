// pybind11 module ep_layer._C: pointers, sizes and the CUDA stream in; no libtorch ABI involved.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime.h"

namespace py = pybind11;
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
py::class_<T> bind_struct(py::module_& m, const char* name, Field<T, M>... fields) {
  py::class_<T> cls(m, name);
  cls.def(py::init([fields...](M... values) {
            T t{};
            ((t.*fields.member = values), ...);
            return t;
          }),
          py::kw_only(), py::arg(fields.name)...);
  (cls.def_readonly(fields.name, fields.member), ...);
  return cls;
}

Common make_common(int rank, int num_ranks, int max_tokens, int hidden, int num_experts, unsigned spec_check,
                   bool system_scope, int gpu_share, const std::vector<long long>& peer_bases, long long local_base,
                   const ep::BufferOffsets& layout, long long host_error, double timeout_s, long long latency) {
  Common c{};
  c.rank = rank;
  c.num_ranks = num_ranks;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.spec_check = spec_check;
  c.system_scope = system_scope;
  if (gpu_share < 1 || gpu_share > num_ranks)
    throw std::invalid_argument("make_common: gpu_share must be in [1, num_ranks]");
  c.gpu_share = gpu_share;
  if (peer_bases.size() != static_cast<size_t>(num_ranks) || num_ranks > ep::kMaxRanks)
    throw std::invalid_argument("make_common: one buffer per rank, at most " + std::to_string(ep::kMaxRanks));
  for (int r = 0; r < num_ranks; ++r) c.peer_bases[r] = peer_bases[r];
  c.local_base = ptr<unsigned char>(local_base);
  c.layout = layout;
  c.host_error = ptr<volatile int>(host_error);
  c.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
  c.latency = ptr<unsigned long long>(latency);
  return c;
}

// Kernels of a dispatch call: the send half, the receive half (the hook), or both as one kernel.
enum DispatchLaunch : int { kSendHalf = 1, kReceiveHalf = 2, kBothHalves = 3 };

void dispatch(const Common& common, int halves, long long ticket, int num_tokens, int num_topk, bool use_fp8,
              bool round_scale, bool use_ue8m0, int chunks_per_slot, long long x, long long topk_idx,
              long long recv_x, long long recv_scales, long long recv_rows, long long recv_count, long long src_info,
              long long layout_range, long long combine_map, long long recv_stats, long long wait_stats,
              long long stream) {
  ep::DispatchCall call{};
  call.c = common;
  call.c.ticket = ptr<unsigned>(ticket);
  call.num_tokens = num_tokens;
  call.num_topk = num_topk;
  call.use_fp8 = use_fp8;
  call.round_scale = round_scale;
  call.use_ue8m0 = use_ue8m0;
  call.chunks_per_slot = chunks_per_slot;
  call.x = ptr<const __nv_bfloat16>(x);
  call.topk_idx = ptr<const long long>(topk_idx);
  call.recv_x = ptr<void>(recv_x);
  call.recv_scales = ptr<void>(recv_scales);
  call.recv_rows = ptr<long long>(recv_rows);
  call.recv_count = ptr<int>(recv_count);
  call.src_info = ptr<int>(src_info);
  call.layout_range = ptr<long long>(layout_range);
  call.combine_map = ptr<int>(combine_map);
  call.recv_stats = ptr<int>(recv_stats);
  call.wait_stats = ptr<long long>(wait_stats);
  if (halves == kSendHalf) {
    ep::dispatch_send(call, ptr<CUstream_st>(stream));
    ep::check_launch("dispatch send kernel");
  } else if (halves == kReceiveHalf) {
    ep::dispatch_recv(call, ptr<CUstream_st>(stream));
    ep::check_launch("dispatch receive kernel");
  } else if (halves == kBothHalves) {
    ep::dispatch_fused(call, ptr<CUstream_st>(stream));
    ep::check_launch("dispatch kernel");
  } else {
    throw std::invalid_argument("ep_layer._C.dispatch: halves must be 1, 2 or 3");
  }
}

void combine(const Common& common, bool send, long long ticket, int num_tokens, int num_topk,
             int blocks_per_expert, long long x, long long x_row, long long recv_count, long long combine_map,
             long long topk_idx, long long topk_weights, long long out, long long wait_stats, long long stream) {
  ep::CombineCall call{};
  call.c = common;
  call.c.ticket = ptr<unsigned>(ticket);
  call.num_tokens = num_tokens;
  call.num_topk = num_topk;
  call.blocks_per_expert = blocks_per_expert;
  call.x = ptr<const __nv_bfloat16>(x);
  call.x_row = x_row;
  call.recv_count = ptr<const int>(recv_count);
  call.combine_map = ptr<const int>(combine_map);
  call.topk_idx = ptr<const long long>(topk_idx);
  call.topk_weights = ptr<const float>(topk_weights);
  call.out = ptr<__nv_bfloat16>(out);
  call.wait_stats = ptr<long long>(wait_stats);
  if (send) {
    ep::combine_send(call, ptr<CUstream_st>(stream));
    ep::check_launch("combine send kernel");
  } else {
    ep::combine_recv(call, ptr<CUstream_st>(stream));
    ep::check_launch("combine receive kernel");
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep-layer CUDA kernels: low-latency dispatch/combine over CUDA IPC peer memory";
  py::class_<Common>(m, "Common");
  using ep::BufferOffsets;
  bind_struct(m, "BufferOffsets", field("control", &BufferOffsets::control), field("half", &BufferOffsets::half),
              field("dispatch", &BufferOffsets::dispatch), field("slot", &BufferOffsets::slot),
              field("combine", &BufferOffsets::combine), field("flags", &BufferOffsets::flags),
              field("counts", &BufferOffsets::counts));
  m.def("make_common", &make_common);
  m.def("dispatch", &dispatch);
  m.def("combine", &combine);
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
  m.def("num_sms", &ep::num_sms);
  m.attr("CONTROL_BYTES") = ep::kControlBytes;
  m.attr("MAX_RANKS") = ep::kMaxRanks;
  m.attr("MAX_TOPK") = ep::kMaxTopk;
  m.attr("MAX_EXPERTS") = ep::kMaxExperts;
  m.attr("DISPATCH_HEADER_BYTES") = ep::kHeaderBytes;
  m.attr("MAX_LATENCY_BOUNDS") = ep::kMaxLatencyBounds;
}
