// CUDA statistics kernels; see tensor_stats_cuda.h for the contract.
// Each request is two launches on the buffer's stream: a statistics pass in
// which every block folds its share of the elements into one partial result
// (16-byte vector loads over whole buffers, per-head matrices or causal row
// prefixes), then a fold of those partials, in index order, into the
// request's slots. Each vector's few elements are summed in float and folded
// into per-thread double sums; a vector holding NaN or inf (or values whose
// float squares would overflow or underflow) takes the per-element path,
// which classifies each element and sums in double.
#include "kernels/tensor_stats_cuda.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

// NaN and inf classification relies on IEEE semantics, and the minimum
// nonzero |x| on subnormals surviving: no fast math, no flush-to-zero.
#ifdef __USE_FAST_MATH__
#error "kernels/tensor_stats_cuda.cu must not be compiled with --use_fast_math"
#endif

namespace nanreplay::cuda {
namespace {

constexpr int kThreads = 256;                 // per block, a power of two (tree reduction)
constexpr int kMaxWholeBlocks = 1024;         // enough to fill any current GPU
constexpr int kMaxPartials = 4096;            // scratch: partial results of one request
constexpr int64_t kElementsPerThread = 64;    // below this much work per thread, fewer blocks
constexpr unsigned long long kNoKey = ULLONG_MAX;

// One partial or final result. The first non-finite element is a key,
// (row-major index << 2) | NonfiniteKind, so that the lowest index (and its
// kind) wins a plain minimum.
struct Accumulator {
  unsigned long long count;
  unsigned long long nan_count;
  unsigned long long inf_count;
  unsigned long long first_key;
  double sum;
  double sum_sq;
  float max_abs;
  float min_nonzero;  // +inf: no nonzero finite element
};

__device__ Accumulator empty_accumulator() {
  return Accumulator{0, 0, 0, kNoKey, 0.0, 0.0, 0.0f, __int_as_float(0x7F800000)};
}

__device__ __forceinline__ void accumulate(Accumulator& a, float x, unsigned long long index) {
  a.count += 1;
  const float magnitude = fabsf(x);
  if (magnitude <= FLT_MAX) {  // finite; false for NaN
    a.max_abs = fmaxf(a.max_abs, magnitude);
    if (magnitude != 0.0f) a.min_nonzero = fminf(a.min_nonzero, magnitude);
    const double value = x;
    a.sum += value;
    a.sum_sq += value * value;  // double: never overflows or underflows for these inputs
    return;
  }
  const bool nan = x != x;
  a.nan_count += nan ? 1 : 0;
  a.inf_count += nan ? 0 : 1;
  const NonfiniteKind kind = nan ? NonfiniteKind::kNan
                             : x > 0.0f ? NonfiniteKind::kPosInf
                                        : NonfiniteKind::kNegInf;
  const unsigned long long key = (index << 2) | static_cast<unsigned long long>(kind);
  a.first_key = key < a.first_key ? key : a.first_key;
}

__device__ __forceinline__ void merge(Accumulator& a, const Accumulator& b) {
  a.count += b.count;
  a.nan_count += b.nan_count;
  a.inf_count += b.inf_count;
  a.first_key = b.first_key < a.first_key ? b.first_key : a.first_key;
  a.sum += b.sum;
  a.sum_sq += b.sum_sq;
  a.max_abs = fmaxf(a.max_abs, b.max_abs);
  a.min_nonzero = fminf(a.min_nonzero, b.min_nonzero);
}

// Tree reduction in a fixed order; the block's result ends in shared[0].
__device__ void reduce_block(Accumulator a, Accumulator* shared) {
  shared[threadIdx.x] = a;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) merge(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
}

struct F32Elem {
  using Raw = float;
  __device__ static float load(float raw) { return raw; }
};
struct BF16Elem {
  using Raw = unsigned short;
  __device__ static float load(unsigned short raw) { return __uint_as_float(unsigned(raw) << 16); }
};
struct F16Elem {
  using Raw = unsigned short;
  __device__ static float load(unsigned short raw) { return __half2float(__ushort_as_half(raw)); }
};

// Below this largest |x| (and nonzero), float squares of a vector's elements
// would underflow: its elements take the per-element double path.
constexpr float kTinyMaxAbs = 0x1p-40f;

// One 16-byte vector (4 or 8 elements). Fast path: float sums of the few
// elements, folded into the double sums once; taken when the float sum of
// squares is finite (no NaN or inf, no overflow) and not all tiny. Otherwise
// each element goes through accumulate(), which classifies it.
template <class Elem>
__device__ __forceinline__ void accumulate_vector(Accumulator& a, const uint4& bits,
                                                  unsigned long long index) {
  using Raw = typename Elem::Raw;
  constexpr int kPerVector = sizeof(uint4) / sizeof(Raw);
  Raw raw[kPerVector];
  memcpy(raw, &bits, sizeof bits);
  float x[kPerVector];
  float max_abs = 0.0f, min_nonzero = __int_as_float(0x7F800000), sum = 0.0f, sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerVector; ++k) {
    x[k] = Elem::load(raw[k]);
    const float magnitude = fabsf(x[k]);
    max_abs = fmaxf(max_abs, magnitude);
    min_nonzero = fminf(min_nonzero, magnitude == 0.0f ? __int_as_float(0x7F800000) : magnitude);
    sum += x[k];
    sum_sq += x[k] * x[k];
  }
  if (sum_sq <= FLT_MAX && (max_abs == 0.0f || max_abs >= kTinyMaxAbs)) {
    a.count += kPerVector;
    a.max_abs = fmaxf(a.max_abs, max_abs);
    a.min_nonzero = fminf(a.min_nonzero, min_nonzero);
    a.sum += sum;
    a.sum_sq += sum_sq;
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerVector; ++k) accumulate(a, x[k], index + k);
}

// Elements [begin, end) of `data`, spread over `stride` threads of which
// this is number `thread`: one at a time up to the first 16-byte boundary,
// then as vectors, then the leftover tail one at a time.
template <class Elem>
__device__ void accumulate_range(const typename Elem::Raw* data, long long begin, long long end,
                                 long long thread, long long stride, Accumulator& a) {
  using Raw = typename Elem::Raw;
  constexpr long long kPerVector = sizeof(uint4) / sizeof(Raw);
  const auto address = reinterpret_cast<uintptr_t>(data + begin);
  const long long to_boundary = address % sizeof(Raw) != 0 ? end - begin  // never aligned
                                : address % sizeof(uint4) == 0
                                    ? 0
                                    : (sizeof(uint4) - address % sizeof(uint4)) / sizeof(Raw);
  const long long vector_begin = begin + (to_boundary < end - begin ? to_boundary : end - begin);
  const long long vector_count = (end - vector_begin) / kPerVector;
  const long long vector_end = vector_begin + vector_count * kPerVector;
  for (long long i = begin + thread; i < vector_begin; i += stride) {
    accumulate(a, Elem::load(data[i]), i);
  }
  const uint4* vectors = reinterpret_cast<const uint4*>(data + vector_begin);
  for (long long v = thread; v < vector_count; v += stride) {
    accumulate_vector<Elem>(a, __ldg(vectors + v), vector_begin + v * kPerVector);
  }
  for (long long i = vector_end + thread; i < end; i += stride) {
    accumulate(a, Elem::load(data[i]), i);
  }
}

// Whole-buffer statistics: the grid strides over the buffer.
template <class Elem>
__global__ void whole_stats_kernel(const typename Elem::Raw* data, long long numel,
                                   Accumulator* partials) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = empty_accumulator();
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  const long long thread = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  accumulate_range<Elem>(data, 0, numel, thread, stride, a);
  reduce_block(a, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}

// Per-head statistics of [batch, heads, rows, cols]: blockIdx.y is the head,
// the blocks along x share its elements. Without a mask each (batch, head)
// matrix is one contiguous range for all of them; with the causal mask each
// row's first row + 1 columns are a range for one block.
template <class Elem>
__global__ void head_stats_kernel(const typename Elem::Raw* data, long long batch, long long heads,
                                  long long rows, long long cols, bool causal,
                                  Accumulator* partials) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = empty_accumulator();
  const long long head = blockIdx.y;
  if (!causal) {
    const long long matrix_size = rows * cols;
    const long long stride = static_cast<long long>(gridDim.x) * kThreads;
    const long long thread = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
    for (long long b = 0; b < batch; ++b) {
      const long long begin = (b * heads + head) * matrix_size;
      accumulate_range<Elem>(data, begin, begin + matrix_size, thread, stride, a);
    }
  } else {
    for (long long task = blockIdx.x; task < batch * rows; task += gridDim.x) {
      const long long b = task / rows, row = task % rows;
      const long long begin = ((b * heads + head) * rows + row) * cols;
      const long long length = row + 1 < cols ? row + 1 : cols;
      accumulate_range<Elem>(data, begin, begin + length, threadIdx.x, kThreads, a);
    }
  }
  reduce_block(a, shared);
  if (threadIdx.x == 0) partials[head * gridDim.x + blockIdx.x] = shared[0];
}

// Folds `per_slot` consecutive partials into each slot, slot blockIdx.x.
__global__ void fold_partials_kernel(const Accumulator* partials, int per_slot, Accumulator* slots) {
  __shared__ Accumulator shared[kThreads];
  Accumulator a = empty_accumulator();
  const Accumulator* mine = partials + static_cast<long long>(blockIdx.x) * per_slot;
  for (int i = threadIdx.x; i < per_slot; i += kThreads) merge(a, mine[i]);
  reduce_block(a, shared);
  if (threadIdx.x == 0) slots[blockIdx.x] = shared[0];
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA statistics: ") + what + ": " +
                             cudaGetErrorString(status));
  }
}

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t clamp_blocks(int64_t wanted, int64_t most) {
  return wanted < 1 ? 1 : wanted > most ? most : wanted;
}

TensorStats to_host_stats(const Accumulator& a) {
  TensorStats s;
  s.count = static_cast<int64_t>(a.count);
  s.nan_count = static_cast<int64_t>(a.nan_count);
  s.inf_count = static_cast<int64_t>(a.inf_count);
  s.finite_count = s.count - s.nan_count - s.inf_count;
  s.max_abs = a.max_abs;
  s.min_nonzero_abs = a.min_nonzero <= FLT_MAX ? a.min_nonzero : 0.0;
  s.sum = a.sum;
  s.sum_sq = a.sum_sq;
  if (a.first_key != kNoKey) {
    s.first_nonfinite = static_cast<int64_t>(a.first_key >> 2);
    s.first_kind = static_cast<NonfiniteKind>(a.first_key & 3);
  }
  return s;
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
    check(cudaMalloc(&impl_->partials, kMaxPartials * sizeof(Accumulator)), "allocating scratch");
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
  const int64_t blocks =
      clamp_blocks(div_up(numel, kThreads * kElementsPerThread), kMaxWholeBlocks);
  const auto grid = static_cast<unsigned>(blocks);
  switch (type) {
    case ElemType::kF32:
      whole_stats_kernel<F32Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const float*>(data), numel, impl_->partials);
      break;
    case ElemType::kBF16:
      whole_stats_kernel<BF16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const unsigned short*>(data), numel, impl_->partials);
      break;
    case ElemType::kF16:
      whole_stats_kernel<F16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const unsigned short*>(data), numel, impl_->partials);
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
  if (heads > kMaxPartials) {
    throw std::invalid_argument("CUDA statistics: more than " + std::to_string(kMaxPartials) +
                                " heads");
  }
  const int64_t first_slot = impl_->take(heads);
  if (heads == 0) return first_slot;
  const int64_t per_head = batch * rows * cols;
  const int64_t blocks_per_head =
      clamp_blocks(div_up(per_head, kThreads * kElementsPerThread), kMaxPartials / heads);
  const dim3 grid(static_cast<unsigned>(blocks_per_head), static_cast<unsigned>(heads));
  switch (type) {
    case ElemType::kF32:
      head_stats_kernel<F32Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const float*>(data), batch, heads, rows, cols, causal, impl_->partials);
      break;
    case ElemType::kBF16:
      head_stats_kernel<BF16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const unsigned short*>(data), batch, heads, rows, cols, causal,
          impl_->partials);
      break;
    case ElemType::kF16:
      head_stats_kernel<F16Elem><<<grid, kThreads, 0, impl_->stream>>>(
          static_cast<const unsigned short*>(data), batch, heads, rows, cols, causal,
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
    for (int64_t i = 0; i < count; ++i) out.push_back(to_host_stats(impl_->host[i]));
  }
  impl_->size = 0;
  return out;
}

}  // namespace nanreplay::cuda
