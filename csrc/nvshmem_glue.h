// The NVSHMEM build's link to the job nvshmem4py started (nvshmem_glue.cu; ep_layer._C_nvshmem only).
#pragma once

#include <tuple>
#include <vector>

namespace ep {

// Gives this module's copy of NVSHMEM's device state (the kernels' puts read it) to the running job:
// nvshmem4py started it on NVSHMEM's one host library, which this module links too.
void attach_nvshmem();
// What this module's kernels see of the job: (my PE, number of PEs, nvshmem_ptr(ptr, pe) for every PE;
// 0 where a PE has no load/store path).
std::tuple<int, int, std::vector<long long>> nvshmem_view(long long ptr);

}  // namespace ep
