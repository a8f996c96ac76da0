// Host-side runtime: the communication buffer, its CUDA IPC handles, the host-mapped error flag.
#include <stdexcept>
#include <string>

#include "runtime.h"

namespace ep {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ep_layer._C: ") + what + ": " + cudaGetErrorString(err));
}

long long alloc_buffer(long long bytes) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc of the communication buffer");
  check_cuda(cudaMemset(p, 0, bytes), "cudaMemset of the communication buffer");
  return reinterpret_cast<long long>(p);
}

void free_buffer(long long ptr) { check_cuda(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree"); }

std::string ipc_handle(long long ptr) {
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

long long ipc_open(const std::string& bytes) {
  if (bytes.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("ipc_open: bad handle size");
  cudaIpcMemHandle_t handle;
  memcpy(&handle, bytes.data(), sizeof(handle));
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<long long>(p);
}

void ipc_close(long long ptr) {
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

std::pair<long long, long long> alloc_host_flag() {
  void* host = nullptr;
  void* dev = nullptr;
  check_cuda(cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped), "cudaHostAlloc of the error flag");
  *static_cast<volatile int*>(host) = 0;
  check_cuda(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
  return {reinterpret_cast<long long>(host), reinterpret_cast<long long>(dev)};
}

void free_host_flag(long long host) { check_cuda(cudaFreeHost(reinterpret_cast<void*>(host)), "cudaFreeHost"); }

int read_host_flag(long long host) { return *reinterpret_cast<volatile int*>(host); }

void clear_host_flag(long long host) { *reinterpret_cast<volatile int*>(host) = 0; }

std::tuple<int, int, unsigned, int> read_error(long long base) {
  ErrorRecord rec;
  const auto* ctrl = reinterpret_cast<const Control*>(base);
  check_cuda(cudaMemcpy(&rec, &ctrl->error, sizeof(rec), cudaMemcpyDeviceToHost), "reading the error record");
  return {rec.code, rec.op, rec.ranks, rec.detail};
}

void clear_error(long long base) {
  auto* ctrl = reinterpret_cast<Control*>(base);
  check_cuda(cudaMemset(&ctrl->error, 0, sizeof(ErrorRecord)), "clearing the error record");
}

// The histogram's bucket bounds, into the kernels' __constant__ tables on the current device.
void set_latency_bounds(const std::vector<unsigned long long>& bounds_ns) {
  const int n = static_cast<int>(bounds_ns.size());
  if (n > kMaxLatencyBounds)
    throw std::invalid_argument("set_latency_bounds: at most " + std::to_string(kMaxLatencyBounds) +
                                " bounds, got " + std::to_string(n));
  for (int i = 1; i < n; ++i)
    if (bounds_ns[i] <= bounds_ns[i - 1]) throw std::invalid_argument("set_latency_bounds: bounds must ascend");
  check_cuda(set_dispatch_latency_bounds(bounds_ns.data(), n), "setting dispatch's latency bounds");
  check_cuda(set_combine_latency_bounds(bounds_ns.data(), n), "setting combine's latency bounds");
}

// The launch counters of both Ops, then their timing records (ll_common.cuh: Timing), flattened:
// [op][record][send_start, send_end, ~recv_start, recv_end]. Synchronous; call it when no kernel of
// this buffer runs.
std::vector<unsigned long long> read_timing(long long base) {
  Control ctrl;
  check_cuda(cudaMemcpy(&ctrl, reinterpret_cast<const void*>(base), sizeof(ctrl), cudaMemcpyDeviceToHost),
             "reading the timing records");
  std::vector<unsigned long long> out(ctrl.launches, ctrl.launches + 2);
  for (const Timing& t : ctrl.timing)
    for (const TimingRecord& r : t.call) out.insert(out.end(), {r.send_start, r.send_end, r.recv_start, r.recv_end});
  return out;
}

void memset_async(long long ptr, long long bytes, long long stream) {
  check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(ptr), 0, bytes, reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemsetAsync");
}

long long create_stream() {
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return reinterpret_cast<long long>(stream);
}

int num_sms() {
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

}  // namespace ep
