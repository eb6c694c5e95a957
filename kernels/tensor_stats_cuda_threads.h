// What each thread of the CUDA statistics kernels does (tensor_stats_cuda.cu),
// written once for nvcc's device code and for plain C++ on the host. The host
// build lets tests/test_kernels_cuda_threads.cpp run every thread of a grid
// in turn on machines without a GPU (CI has nvcc but no device) and compare
// the result with the CPU kernel, checking the index arithmetic and that
// every 16-byte vector load is aligned. Launch geometry lives here too, so the
// emulation covers exactly the grid a launch would use.
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "kernels/tensor_stats.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define NANREPLAY_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NANREPLAY_HOST_DEVICE inline
#endif
// Loops over a vector's lanes are unrolled in device code; host compilers
// do not know the pragma.
#if defined(__CUDA_ARCH__)
#define NANREPLAY_UNROLL _Pragma("unroll")
#else
#define NANREPLAY_UNROLL
#endif

namespace nanreplay::cuda::threads {

constexpr int kThreads = 256;               // per block, a power of two (tree reduction)
constexpr int64_t kMaxWholeBlocks = 1024;   // enough to fill any current GPU
constexpr int64_t kMaxPartials = 4096;      // scratch: partial results of one request
constexpr int64_t kElementsPerThread = 64;  // below this much work per thread, fewer blocks
constexpr unsigned long long kNoKey = ULLONG_MAX;
// Below this largest |x| (and nonzero), float squares of a vector's elements
// would underflow: its elements take the per-element double path.
constexpr float kTinyMaxAbs = 0x1p-40f;

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

NANREPLAY_HOST_DEVICE float float_from_bits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

NANREPLAY_HOST_DEVICE float positive_infinity() { return float_from_bits(0x7F800000u); }

NANREPLAY_HOST_DEVICE Accumulator empty_accumulator() {
  return Accumulator{0, 0, 0, kNoKey, 0.0, 0.0, 0.0f, positive_infinity()};
}

// One element, classified: finite ones enter the sums (in double), NaN and
// inf are counted and compete for the first non-finite key.
NANREPLAY_HOST_DEVICE void accumulate(Accumulator& a, float x, unsigned long long index) {
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

NANREPLAY_HOST_DEVICE void merge(Accumulator& a, const Accumulator& b) {
  a.count += b.count;
  a.nan_count += b.nan_count;
  a.inf_count += b.inf_count;
  a.first_key = b.first_key < a.first_key ? b.first_key : a.first_key;
  a.sum += b.sum;
  a.sum_sq += b.sum_sq;
  a.max_abs = fmaxf(a.max_abs, b.max_abs);
  a.min_nonzero = fminf(a.min_nonzero, b.min_nonzero);
}

struct F32Elem {
  using Raw = float;
  NANREPLAY_HOST_DEVICE static float load(float raw) { return raw; }
};
struct BF16Elem {
  using Raw = uint16_t;
  NANREPLAY_HOST_DEVICE static float load(uint16_t raw) { return float_from_bits(uint32_t{raw} << 16); }
};
struct F16Elem {
  using Raw = uint16_t;
  NANREPLAY_HOST_DEVICE static float load(uint16_t raw) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(raw));
#else
    return f16_to_float(raw);  // the CPU kernel's exact decoder
#endif
  }
};

// 16 bytes read at once: 4 f32 or 8 bf16/f16 elements.
struct alignas(16) Vector16 {
  uint32_t words[4];
};

// On the device a read-only-cache vector load; on the host (emulation) a copy
// that refuses a misaligned address, which on a GPU would fault.
NANREPLAY_HOST_DEVICE Vector16 load_vector(const Vector16* p) {
#if defined(__CUDA_ARCH__)
  const uint4 bits = __ldg(reinterpret_cast<const uint4*>(p));
  return Vector16{{bits.x, bits.y, bits.z, bits.w}};
#else
  if (reinterpret_cast<uintptr_t>(p) % sizeof(Vector16) != 0) {
    throw std::logic_error("CUDA statistics: misaligned 16-byte load");
  }
  return *p;
#endif
}

// One vector. Fast path: float sums of its few elements, folded into the
// double sums once; taken when the float sum of squares is finite (no NaN or
// inf, no overflow) and not all tiny. Otherwise each element goes through
// accumulate(), which classifies it.
template <class Elem>
NANREPLAY_HOST_DEVICE void accumulate_vector(Accumulator& a, const Vector16& bits,
                                             unsigned long long index) {
  using Raw = typename Elem::Raw;
  constexpr int kPerVector = sizeof(Vector16) / sizeof(Raw);
  Raw raw[kPerVector];
  memcpy(raw, &bits, sizeof bits);
  float x[kPerVector];
  float max_abs = 0.0f, min_nonzero = positive_infinity(), sum = 0.0f, sum_sq = 0.0f;
NANREPLAY_UNROLL
  for (int k = 0; k < kPerVector; ++k) {
    x[k] = Elem::load(raw[k]);
    const float magnitude = fabsf(x[k]);
    max_abs = fmaxf(max_abs, magnitude);
    min_nonzero = fminf(min_nonzero, magnitude == 0.0f ? positive_infinity() : magnitude);
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
NANREPLAY_UNROLL
  for (int k = 0; k < kPerVector; ++k) accumulate(a, x[k], index + k);
}

// Elements [begin, end) of `data`, spread over `stride` threads of which
// this is number `thread`: one at a time up to the first 16-byte boundary,
// then as vectors, then the leftover tail one at a time.
template <class Elem>
NANREPLAY_HOST_DEVICE void accumulate_range(const typename Elem::Raw* data, int64_t begin,
                                            int64_t end, int64_t thread, int64_t stride,
                                            Accumulator& a) {
  using Raw = typename Elem::Raw;
  constexpr int64_t kPerVector = sizeof(Vector16) / sizeof(Raw);
  const auto address = reinterpret_cast<uintptr_t>(data + begin);
  const int64_t length = end - begin;
  const int64_t to_boundary =
      address % sizeof(Raw) != 0             ? length  // never aligned: all one at a time
      : address % sizeof(Vector16) == 0 ? 0
                                        : static_cast<int64_t>((sizeof(Vector16) - address % sizeof(Vector16)) / sizeof(Raw));
  const int64_t vector_begin = begin + (to_boundary < length ? to_boundary : length);
  const int64_t vector_count = (end - vector_begin) / kPerVector;
  const int64_t vector_end = vector_begin + vector_count * kPerVector;
  for (int64_t i = begin + thread; i < vector_begin; i += stride) {
    accumulate(a, Elem::load(data[i]), static_cast<unsigned long long>(i));
  }
  const auto* vectors = reinterpret_cast<const Vector16*>(data + vector_begin);
  for (int64_t v = thread; v < vector_count; v += stride) {
    accumulate_vector<Elem>(a, load_vector(vectors + v),
                            static_cast<unsigned long long>(vector_begin + v * kPerVector));
  }
  for (int64_t i = vector_end + thread; i < end; i += stride) {
    accumulate(a, Elem::load(data[i]), static_cast<unsigned long long>(i));
  }
}

// --- Launch geometry and each thread's share of a request.

NANREPLAY_HOST_DEVICE int64_t clamp_blocks(int64_t wanted, int64_t most) {
  return wanted < 1 ? 1 : wanted > most ? most : wanted;
}

// Blocks of a whole-buffer request: fixed by the size, so results are too.
NANREPLAY_HOST_DEVICE int64_t whole_blocks(int64_t numel) {
  return clamp_blocks((numel + kThreads * kElementsPerThread - 1) / (kThreads * kElementsPerThread),
                      kMaxWholeBlocks);
}

// Blocks per head of a per-head request (heads <= kMaxPartials).
NANREPLAY_HOST_DEVICE int64_t head_blocks(int64_t batch, int64_t heads, int64_t rows, int64_t cols) {
  const int64_t per_head = batch * rows * cols;
  return clamp_blocks((per_head + kThreads * kElementsPerThread - 1) / (kThreads * kElementsPerThread),
                      kMaxPartials / heads);
}

// Thread `thread` of block `block` of a whole-buffer request: the grid strides over the buffer.
template <class Elem>
NANREPLAY_HOST_DEVICE void whole_thread(const typename Elem::Raw* data, int64_t numel, int64_t blocks,
                                        int64_t block, int thread, Accumulator& a) {
  accumulate_range<Elem>(data, 0, numel, block * kThreads + thread, blocks * kThreads, a);
}

// Thread `thread` of block `block` (of `blocks` per head) working on head
// `head` of [batch, heads, rows, cols]. Without a mask each (batch, head)
// matrix is one contiguous range for all the head's blocks; with the causal
// mask each row's first row + 1 columns are a range for one block.
template <class Elem>
NANREPLAY_HOST_DEVICE void head_thread(const typename Elem::Raw* data, int64_t batch, int64_t heads,
                                       int64_t rows, int64_t cols, bool causal, int64_t head,
                                       int64_t blocks, int64_t block, int thread, Accumulator& a) {
  if (!causal) {
    const int64_t matrix_size = rows * cols;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t begin = (b * heads + head) * matrix_size;
      accumulate_range<Elem>(data, begin, begin + matrix_size, block * kThreads + thread,
                             blocks * kThreads, a);
    }
    return;
  }
  for (int64_t task = block; task < batch * rows; task += blocks) {
    const int64_t b = task / rows, row = task % rows;
    const int64_t begin = ((b * heads + head) * rows + row) * cols;
    const int64_t length = row + 1 < cols ? row + 1 : cols;
    accumulate_range<Elem>(data, begin, begin + length, thread, kThreads, a);
  }
}

// The host's view of a finished slot.
inline TensorStats to_tensor_stats(const Accumulator& a) {
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

}  // namespace nanreplay::cuda::threads
