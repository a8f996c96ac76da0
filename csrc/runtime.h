// Host-side runtime functions bound to Python (see runtime.cu).
#pragma once

#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ll_common.cuh"

namespace ep {

void check_cuda(cudaError_t err, const char* what);
void check_launch(const char* kernel);
long long alloc_buffer(long long bytes);
void free_buffer(long long ptr);
std::string ipc_handle(long long ptr);
long long ipc_open(const std::string& bytes);
void ipc_close(long long ptr);
std::pair<long long, long long> alloc_host_flag();
void free_host_flag(long long host);
int read_host_flag(long long host);
void clear_host_flag(long long host);
std::tuple<int, int, unsigned, int> read_error(long long base);
void clear_error(long long base);
void set_latency_bounds(const std::vector<unsigned long long>& bounds_ns);
std::vector<unsigned long long> read_timing(long long base);
void memset_async(long long ptr, long long bytes, long long stream);
long long create_stream();  // a non-blocking stream of the current device, never destroyed
int num_sms();

}  // namespace ep
