// Links ep_layer._C_nvshmem to the NVSHMEM job nvshmem4py started (see nvshmem_glue.h).
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <stdexcept>

#include "nvshmem_glue.h"
#include "runtime.h"

namespace ep {
namespace {

__global__ void view_kernel(const void* p, int* pes, long long* ptrs, int max_pes) {
  pes[0] = nvshmem_my_pe();
  pes[1] = nvshmem_n_pes();
  for (int pe = 0; pe < pes[1] && pe < max_pes; ++pe) ptrs[pe] = reinterpret_cast<long long>(nvshmem_ptr(p, pe));
}

}  // namespace

void attach_nvshmem() {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error("attach_nvshmem: no NVSHMEM job runs in this process (ep_layer.backends.nvshmem_heap.join "
                             "starts it)");
  // With the host library already running, this registers the device state of this module's kernels.
  if (nvshmemx_init_attr(0, nullptr) != 0) throw std::runtime_error("attach_nvshmem: NVSHMEM's init failed");
}

std::tuple<int, int, std::vector<long long>> nvshmem_view(long long ptr) {
  constexpr int kMaxPes = 1024;
  int* pes = nullptr;
  long long* ptrs = nullptr;
  check_cuda(cudaMalloc(&pes, 2 * sizeof(int)), "cudaMalloc");
  check_cuda(cudaMalloc(&ptrs, kMaxPes * sizeof(long long)), "cudaMalloc");
  view_kernel<<<1, 1>>>(reinterpret_cast<const void*>(ptr), pes, ptrs, kMaxPes);
  check_launch("NVSHMEM view kernel");
  int host_pes[2] = {0, 0};
  check_cuda(cudaMemcpy(host_pes, pes, sizeof(host_pes), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::vector<long long> host_ptrs(std::max(0, std::min(host_pes[1], kMaxPes)));
  if (!host_ptrs.empty())
    check_cuda(cudaMemcpy(host_ptrs.data(), ptrs, host_ptrs.size() * sizeof(long long), cudaMemcpyDeviceToHost),
               "cudaMemcpy");
  check_cuda(cudaFree(pes), "cudaFree");
  check_cuda(cudaFree(ptrs), "cudaFree");
  return {host_pes[0], host_pes[1], host_ptrs};
}

}  // namespace ep
