// The CUDA twin of the fused statistics kernel (tensor_stats.h): the same
// statistics of f32/bf16/f16 buffers in device memory, whole or per head, in
// one read. Results land in slots of a buffer that lives in device memory and
// nothing comes back until collect(), which a replay calls once per step: one
// cudaMemcpyAsync and one stream synchronisation, however many tensors were
// probed. Deterministic: for a given shape the grid is fixed and partial
// results are reduced in a fixed order (no atomics), so a replay can compare
// two runs bit for bit. Built only with NANREPLAY_CUDA; includers need no CUDA
// headers (a stream is passed as the runtime's opaque CUstream_st pointer).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/tensor_stats.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace nanreplay::cuda {

// True when the CUDA runtime reports at least one usable device.
bool device_available();

class DeviceStatsBuffer {
 public:
  // Room for `capacity` statistics (one per whole tensor, one per head).
  // Work is queued on `stream` (null: the legacy default stream).
  explicit DeviceStatsBuffer(int64_t capacity, CUstream_st* stream = nullptr);
  ~DeviceStatsBuffer();
  DeviceStatsBuffer(const DeviceStatsBuffer&) = delete;
  DeviceStatsBuffer& operator=(const DeviceStatsBuffer&) = delete;

  // Queues statistics of `numel` elements at device address `data`; returns
  // the slot their result will occupy in collect()'s vector. Never waits.
  int64_t add(const void* data, ElemType type, int64_t numel);

  // Queues per-head statistics of a contiguous [batch, heads, rows, cols]
  // device buffer, with the CPU kernel's meaning of `causal` (elements with
  // col > row skipped, rows == cols); returns the first of `heads`
  // consecutive slots. combine_heads() gives the whole-tensor statistics.
  int64_t add_heads(const void* data, ElemType type, int64_t batch, int64_t heads, int64_t rows,
                    int64_t cols, bool causal);

  // Slots queued since the last collect().
  int64_t size() const;
  int64_t capacity() const;

  // Copies every queued slot to the host (one cudaMemcpyAsync, then waits
  // for the stream) and empties the buffer for the next step.
  std::vector<TensorStats> collect();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nanreplay::cuda
