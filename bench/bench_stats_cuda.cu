// Throughput of the CUDA statistics kernel against a plain float sum kernel
// over the same device buffer (one read of the memory, the floor), side by
// side: each repetition runs every case once, timed with CUDA events
// including the collect() that brings results back; figures are medians.
// Usage: bench_stats_cuda [MiB] [repetitions]   (default 1024 MiB, 21)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/tensor_stats_cuda.h"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "bench_stats_cuda: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// The floor: every thread sums its grid-stride share, one atomic per block.
__global__ void plain_sum_kernel(const float4* data, long long count, float* out) {
  __shared__ float shared[256];
  float sum = 0.0f;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < count; i += gridDim.x * 256LL) {
    const float4 v = data[i];
    sum += v.x + v.y + v.z + v.w;
  }
  shared[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = 128; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, shared[0]);
}

struct Case {
  std::string name;
  double bytes;
  std::function<void()> run;
  std::vector<float> ms;
  double gbs() const {
    std::vector<float> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    return bytes / (sorted[sorted.size() / 2] * 1e-3) / 1e9;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (!nanreplay::cuda::device_available()) {
    std::printf("no CUDA device\n");
    return 77;
  }
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int repetitions = argc > 2 ? std::max(1, std::atoi(argv[2])) : 21;
  const int64_t bytes = mib << 20;
  std::vector<float> host(static_cast<size_t>(bytes / 4));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : host) x = normal(rng);
  void* device = nullptr;
  float* sum = nullptr;
  check(cudaMalloc(&device, static_cast<size_t>(bytes)), "cudaMalloc");
  check(cudaMalloc(&sum, sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(device, host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice), "cudaMemcpy");
  // The same bytes read as halves: random bf16 and f16 patterns, NaN included for f16.
  nanreplay::cuda::DeviceStatsBuffer results(64);
  using nanreplay::ElemType;
  auto stats = [&](ElemType type, int64_t numel) {
    return [&results, type, numel, device] {
      results.add(device, type, numel);
      results.collect();
    };
  };
  const int64_t batch = 4, heads = 16, rows = 2048;  // 512 MiB of f16 scores
  const int64_t head_bytes = batch * heads * rows * rows * 2;
  std::vector<Case> cases = {
      {"plain float sum f32", double(bytes),
       [&] {
         plain_sum_kernel<<<1024, 256>>>(static_cast<const float4*>(device), bytes / 16, sum);
         float out;
         cudaMemcpy(&out, sum, sizeof out, cudaMemcpyDeviceToHost);
       }, {}},
      {"stats f32", double(bytes), stats(ElemType::kF32, bytes / 4), {}},
      {"stats bf16", double(bytes), stats(ElemType::kBF16, bytes / 2), {}},
      {"stats f16", double(bytes), stats(ElemType::kF16, bytes / 2), {}},
  };
  if (head_bytes <= bytes) {
    cases.push_back({"per-head causal f16 [4,16,2048,2048] (half read)", double(head_bytes) / 2,
                     [&] {
                       results.add_heads(device, ElemType::kF16, batch, heads, rows, rows, true);
                       results.collect();
                     }, {}});
    cases.push_back({"per-head f16 [4,16,2048,2048]", double(head_bytes),
                     [&] {
                       results.add_heads(device, ElemType::kF16, batch, heads, rows, rows, false);
                       results.collect();
                     }, {}});
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (Case& c : cases) c.run();
  for (int r = 0; r < repetitions; ++r) {
    for (Case& c : cases) {
      cudaEventRecord(start);
      c.run();
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      c.ms.push_back(ms);
    }
  }
  check(cudaGetLastError(), "kernels");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, buffer %lld MiB, median of %d interleaved repetitions\n", prop.name,
              static_cast<long long>(mib), repetitions);
  const double floor = cases[0].gbs();
  for (const Case& c : cases) {
    std::printf("  %-50s %8.1f GB/s   x%.2f of plain sum\n", c.name.c_str(), c.gbs(), c.gbs() / floor);
  }
  cudaFree(device);
  cudaFree(sum);
  return 0;
}
