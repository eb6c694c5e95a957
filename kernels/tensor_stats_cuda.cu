// CUDA statistics kernels; see tensor_stats_cuda.h for the contract.
// Each request is two launches on the buffer's stream: a statistics pass in
// which every block folds its threads' shares (tensor_stats_cuda_threads.h:
// 16-byte vector loads, float sums per vector folded into double, NaN and inf
// classified per element) into one partial result by a fixed tree, then a
// fold of those partials, in index order, into the request's slots.
#include "kernels/tensor_stats_cuda.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

// NaN and inf classification relies on IEEE semantics, and the minimum
// nonzero |x| on subnormals surviving: no fast math, no flush-to-zero.
#ifdef __USE_FAST_MATH__
#error "kernels/tensor_stats_cuda.cu must not be compiled with --use_fast_math"
#endif

#include "kernels/tensor_stats_cuda_threads.h"

namespace nanreplay::cuda {
namespace {

using threads::Accumulator;
using threads::kThreads;

// Tree reduction in a fixed order; the block's result ends in shared[0].
__device__ void reduce_block(Accumulator a, Accumulator* shared) {
  shared[threadIdx.x] = a;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) threads::merge(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
}

template <class Elem>
__global__ void whole_stats_kernel(const typename Elem::Raw* data, long long numel,
                                   Accumulator* partials) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = threads::empty_accumulator();
  threads::whole_thread<Elem>(data, numel, gridDim.x, blockIdx.x, threadIdx.x, a);
  reduce_block(a, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}

// blockIdx.y is the head; the blocks along x share its elements.
template <class Elem>
__global__ void head_stats_kernel(const typename Elem::Raw* data, long long batch, long long heads,
                                  long long rows, long long cols, bool causal,
                                  Accumulator* partials) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = threads::empty_accumulator();
  threads::head_thread<Elem>(data, batch, heads, rows, cols, causal, blockIdx.y, gridDim.x,
                             blockIdx.x, threadIdx.x, a);
  reduce_block(a, shared);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = shared[0];
}

// Folds `per_slot` consecutive partials into each slot, slot blockIdx.x.
__global__ void fold_partials_kernel(const Accumulator* partials, int per_slot, Accumulator* slots) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = threads::empty_accumulator();
  const Accumulator* mine = partials + static_cast<long long>(blockIdx.x) * per_slot;
  for (int i = threadIdx.x; i < per_slot; i += kThreads) threads::merge(a, mine[i]);
  reduce_block(a, shared);
  if (threadIdx.x == 0) slots[blockIdx.x] = shared[0];
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA statistics: ") + what + ": " +
                             cudaGetErrorString(status));
  }
}

}  // namespace

struct DeviceStatsBuffer::Impl {
  cudaStream_t stream = nullptr;
  int64_t capacity = 0;
  int64_t size = 0;
  Accumulator* slots = nullptr;     // device: one result per slot
  Accumulator* partials = nullptr;  // device: scratch of the request in flight
  Accumulator* host = nullptr;      // pinned: collect()'s copy target

  // Reserves `count` slots; throws before anything is queued when full.
  int64_t take(int64_t count) {
    if (size + count > capacity) {
      throw std::length_error("CUDA statistics: " + std::to_string(size + count) +
                              " slots needed, capacity " + std::to_string(capacity));
    }
    const int64_t first = size;
    size += count;
    return first;
  }

  void fold(int64_t first_slot, int64_t slot_count, int64_t per_slot) {
    fold_partials_kernel<<<static_cast<unsigned>(slot_count), kThreads, 0, stream>>>(
        partials, static_cast<int>(per_slot), slots + first_slot);
    check(cudaGetLastError(), "launching the fold");
  }
};

bool device_available() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error, report none
    return false;
  }
  return count > 0;
}

DeviceStatsBuffer::DeviceStatsBuffer(int64_t capacity, CUstream_st* stream)
    : impl_(std::make_unique<Impl>()) {
  if (capacity <= 0) throw std::invalid_argument("CUDA statistics: capacity must be positive");
  impl_->stream = stream;
  impl_->capacity = capacity;
  const size_t slot_bytes = static_cast<size_t>(capacity) * sizeof(Accumulator);
  try {
    check(cudaMalloc(&impl_->slots, slot_bytes), "allocating the slots");
    check(cudaMalloc(&impl_->partials, threads::kMaxPartials * sizeof(Accumulator)), "allocating scratch");
    check(cudaMallocHost(&impl_->host, slot_bytes), "allocating the pinned copy");
  } catch (...) {
    cudaFree(impl_->slots);
    cudaFree(impl_->partials);
    throw;
  }
}

DeviceStatsBuffer::~DeviceStatsBuffer() {
  cudaFree(impl_->slots);
  cudaFree(impl_->partials);
  cudaFreeHost(impl_->host);
}

int64_t DeviceStatsBuffer::size() const { return impl_->size; }
int64_t DeviceStatsBuffer::capacity() const { return impl_->capacity; }

int64_t DeviceStatsBuffer::add(const void* data, ElemType type, int64_t numel) {
  if (numel < 0) throw std::invalid_argument("CUDA statistics: negative element count");
  const int64_t slot = impl_->take(1);
  if (numel == 0) {
    impl_->fold(slot, 1, 0);  // an empty result
    return slot;
  }
  const int64_t blocks = threads::whole_blocks(numel);
  const auto grid = static_cast<unsigned>(blocks);
  switch (type) {
    case ElemType::kF32:
      whole_stats_kernel<threads::F32Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const float*>(data), numel, impl_->partials);
      break;
    case ElemType::kBF16:
      whole_stats_kernel<threads::BF16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const uint16_t*>(data), numel, impl_->partials);
      break;
    case ElemType::kF16:
      whole_stats_kernel<threads::F16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const uint16_t*>(data), numel, impl_->partials);
      break;
  }
  check(cudaGetLastError(), "launching whole-buffer statistics");
  impl_->fold(slot, 1, blocks);
  return slot;
}

int64_t DeviceStatsBuffer::add_heads(const void* data, ElemType type, int64_t batch, int64_t heads,
                                     int64_t rows, int64_t cols, bool causal) {
  if (batch < 0 || heads < 0 || rows < 0 || cols < 0) {
    throw std::invalid_argument("CUDA statistics: negative dimension");
  }
  if (causal && rows != cols) {
    throw std::invalid_argument("CUDA statistics: causal statistics need rows == cols");
  }
  if (heads > threads::kMaxPartials) {
    throw std::invalid_argument("CUDA statistics: more than " + std::to_string(threads::kMaxPartials) +
                                " heads");
  }
  const int64_t first_slot = impl_->take(heads);
  if (heads == 0) return first_slot;
  const int64_t blocks_per_head = threads::head_blocks(batch, heads, rows, cols);
  const dim3 grid(static_cast<unsigned>(blocks_per_head), static_cast<unsigned>(heads));
  switch (type) {
    case ElemType::kF32:
      head_stats_kernel<threads::F32Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const float*>(data), batch, heads, rows, cols, causal, impl_->partials);
      break;
    case ElemType::kBF16:
      head_stats_kernel<threads::BF16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const uint16_t*>(data), batch, heads, rows, cols, causal,
          impl_->partials);
      break;
    case ElemType::kF16:
      head_stats_kernel<threads::F16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const uint16_t*>(data), batch, heads, rows, cols, causal,
          impl_->partials);
      break;
  }
  check(cudaGetLastError(), "launching per-head statistics");
  impl_->fold(first_slot, heads, blocks_per_head);
  return first_slot;
}

std::vector<TensorStats> DeviceStatsBuffer::collect() {
  const int64_t count = impl_->size;
  std::vector<TensorStats> out;
  out.reserve(static_cast<size_t>(count));
  if (count > 0) {
    check(cudaMemcpyAsync(impl_->host, impl_->slots, static_cast<size_t>(count) * sizeof(Accumulator),
                          cudaMemcpyDeviceToHost, impl_->stream),
          "copying the results");
    check(cudaStreamSynchronize(impl_->stream), "waiting for the statistics");
    for (int64_t i = 0; i < count; ++i) out.push_back(threads::to_tensor_stats(impl_->host[i]));
  }
  impl_->size = 0;
  return out;
}

}  // namespace nanreplay::cuda
