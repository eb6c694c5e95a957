// Probe statistics of CUDA tensors through the fused CUDA kernel
// (kernels/tensor_stats_cuda.h) instead of LibTorch reductions: each probe is
// queued on the tensor's current stream into a device-resident buffer, and
// collect() reads every slot back with one copy and one synchronisation per
// buffer. Present when the build has both a CUDA LibTorch and nvcc
// (NANREPLAY_TORCH_CUDA and NANREPLAY_HAVE_CUDA); available() says so at run
// time, and NANREPLAY_GPU_STATS=torch chooses the LibTorch reductions instead
// (device_stats.h), so the two can be compared on a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "kernels/tensor_stats.h"

namespace nanreplay {

class CudaProbeStats {
 public:
  // Where a queued probe's results will be: `count` consecutive results
  // from `first` in the vector collect() returns.
  struct Ticket {
    int64_t first = 0;
    int64_t count = 0;
  };

  // True when this build carries the kernel and it was not turned off.
  static bool available();

  CudaProbeStats();
  ~CudaProbeStats();
  CudaProbeStats(const CudaProbeStats&) = delete;
  CudaProbeStats& operator=(const CudaProbeStats&) = delete;

  // Whether the kernel takes `t` (a CUDA tensor of f32, bf16 or f16).
  static bool accepts(const torch::Tensor& t);

  // Queues the statistics of `t`: one result for the whole tensor, or one
  // per head of a [batch, heads, rows, cols] tensor. Never waits.
  Ticket add(const torch::Tensor& t, bool per_head, bool causal);

  // Every queued result, in the order of the tickets; empties the queue.
  std::vector<TensorStats> collect();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nanreplay
