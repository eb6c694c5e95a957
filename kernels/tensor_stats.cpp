// The fused statistics kernel: one read of the buffer per probe. Elements are
// scanned in blocks of 4096 through a branch-free float fast path the compiler
// vectorizes; only a block whose float sums come out non-finite (it holds a NaN
// or inf), or whose values are too tiny for float squares, is rescanned by the
// exact path (double sums, every element classified, first non-finite located).
// Chunk boundaries are fixed by size, so results do not depend on thread count.
#include "kernels/tensor_stats.h"

#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(NANREPLAY_NO_SIMD_CLONES)
#include <immintrin.h>
#define NANREPLAY_F16C 1
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>

// NaN and inf detection below relies on IEEE semantics (x != x, sums turning
// non-finite); -ffast-math would let the compiler assume them away.
#ifdef __FAST_MATH__
#error "kernels/tensor_stats.cpp must not be compiled with -ffast-math"
#endif

// On x86-64 glibc, the hot loops are compiled twice, for AVX2 and for the
// baseline, and the loader picks one at startup: twice the lanes where the
// CPU has them, while the build itself stays portable. Defining
// NANREPLAY_NO_SIMD_CLONES builds the baseline only (to test it on AVX2 hosts).
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && defined(__GNUC__) && \
    !defined(NANREPLAY_NO_SIMD_CLONES)
#define NANREPLAY_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define NANREPLAY_SIMD_CLONES
#endif

namespace nanreplay {
namespace {

// Fast-path granularity: float partial sums cover at most kBlock elements
// (kBlock / SIMD width per lane) before they are folded into double, and a
// block holding a non-finite element is what the exact path rescans, so a NaN
// costs one block of extra work, not the whole buffer.
constexpr int64_t kBlock = 4096;
// One parallel task; a multiple of kBlock so block boundaries never move.
constexpr int64_t kChunk = int64_t{1} << 18;
// Below this many elements threading costs more than it saves.
constexpr int64_t kParallelThreshold = int64_t{1} << 20;
// A block whose largest |x| is below this (and nonzero) is summed in double:
// float squares of such values would underflow and lose the whole sum.
constexpr float kTinyMaxAbs = 0x1p-40f;
// Runs gathered into one fast-path group (causal rows are short runs).
constexpr int kMaxRunsPerGroup = 64;

constexpr float kInf = std::numeric_limits<float>::infinity();

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t bits_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float decode_bf16(uint16_t bits) { return float_from_bits(uint32_t{bits} << 16); }

// Branch-free (integer selects only) so it vectorizes inside the fast loop.
// Subnormal halves never produce a float subnormal on the way (2^-14 + m*2^-24
// minus 2^-14, exact), so the result holds even with denormals-are-zero on.
inline float decode_f16(uint16_t bits) {
  const int32_t magnitude = bits & 0x7FFF;
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t shifted = uint32_t(magnitude) << 13;
  // Normal halves: rebias the exponent by 127 - 15; inf and NaN (exponent 31)
  // need the bias twice to land on exponent 255.
  constexpr uint32_t kRebias = uint32_t{127 - 15} << 23;
  const uint32_t normal = shifted + kRebias + (magnitude >= 0x7C00 ? kRebias : 0u);
  constexpr uint32_t kTwoToMinus14 = uint32_t{127 - 14} << 23;
  const float subnormal = float_from_bits(shifted + kTwoToMinus14) - float_from_bits(kTwoToMinus14);
  // A mask rather than `?:` on floats: the compiler may not if-convert a float
  // operation it has sunk into a branch, and then the loop stays scalar.
  const uint32_t is_subnormal = 0u - uint32_t{magnitude < 0x0400};
  return float_from_bits((bits_from_float(subnormal) & is_subnormal) | (normal & ~is_subnormal) |
                         sign);
}

struct F32Elem {
  using Raw = float;
  static float load(float raw) { return raw; }
};
struct BF16Elem {
  using Raw = uint16_t;
  static float load(uint16_t raw) { return decode_bf16(raw); }
};
struct F16Elem {
  using Raw = uint16_t;
  static float load(uint16_t raw) { return decode_f16(raw); }
};

// A contiguous stretch of elements starting at `offset` (row-major index).
struct Run {
  int64_t offset;
  int64_t length;
};

// Vector lanes for the hot loops: multiples of this many elements go through
// `omp simd`, so the compiler needs no epilogue (at -O2 its cheap cost model
// refuses loops that would); the few leftover elements run one at a time.
constexpr int64_t kSimdStep = 16;

// Accumulators of the exact path: double sums, counts of what was left out.
struct ExactSums {
  int64_t nan_count = 0;
  int64_t inf_count = 0;
  double max_abs = 0.0;
  double min_nonzero = std::numeric_limits<double>::infinity();
  double sum = 0.0;
  double sum_sq = 0.0;
};

// Classifies one element; a non-finite one counts, then enters the sums as 0.
inline void accumulate_exact(float x, int64_t& nan_count, int64_t& inf_count, double& max_abs,
                             double& min_nonzero, double& sum, double& sum_sq) {
  // Integer selects only: a float conversion under a condition is control flow
  // the compiler may not if-convert, and the loop would stay scalar.
  const float float_magnitude = std::fabs(x);
  nan_count += x != x ? 1 : 0;
  inf_count += float_magnitude == kInf ? 1 : 0;
  const uint32_t keep_mask = 0u - uint32_t{float_magnitude <= FLT_MAX};
  const double value = float_from_bits(bits_from_float(x) & keep_mask);
  const double magnitude = std::fabs(value);
  max_abs = std::max(max_abs, magnitude);
  min_nonzero = std::min(min_nonzero, magnitude == 0.0 ? double{kInf} : magnitude);
  sum += value;
  sum_sq += value * value;  // in double: float squares never overflow or underflow here
}

// The exact path over one run: masked rather than branching, so a tensor with
// a NaN in every block (one bad channel) still scans at vector speed.
template <class Elem>
NANREPLAY_SIMD_CLONES void accumulate_run_exact(const typename Elem::Raw* p, int64_t n,
                                                ExactSums& sums) {
  const int64_t vector_part = n & ~(kSimdStep - 1);
  int64_t nan_count = sums.nan_count, inf_count = sums.inf_count;
  double max_abs = sums.max_abs, min_nonzero = sums.min_nonzero;
  double sum = sums.sum, sum_sq = sums.sum_sq;
#pragma omp simd reduction(+ : nan_count, inf_count, sum, sum_sq) reduction(max : max_abs) \
    reduction(min : min_nonzero)
  for (int64_t i = 0; i < vector_part; ++i) {
    accumulate_exact(Elem::load(p[i]), nan_count, inf_count, max_abs, min_nonzero, sum, sum_sq);
  }
  for (int64_t i = vector_part; i < n; ++i) {
    accumulate_exact(Elem::load(p[i]), nan_count, inf_count, max_abs, min_nonzero, sum, sum_sq);
  }
  sums = ExactSums{nan_count, inf_count, max_abs, min_nonzero, sum, sum_sq};
}

// Exact path: doubles throughout, every element classified; then, if this is
// the first non-finite element seen, a scalar search for where it is.
template <class Elem>
void scan_exact(const typename Elem::Raw* data, const Run& run, TensorStats& out) {
  ExactSums sums;
  accumulate_run_exact<Elem>(data + run.offset, run.length, sums);
  const int64_t nonfinite = sums.nan_count + sums.inf_count;
  out.count += run.length;
  out.finite_count += run.length - nonfinite;
  out.nan_count += sums.nan_count;
  out.inf_count += sums.inf_count;
  out.max_abs = std::max(out.max_abs, sums.max_abs);
  if (sums.min_nonzero != kInf &&
      (out.min_nonzero_abs == 0 || sums.min_nonzero < out.min_nonzero_abs)) {
    out.min_nonzero_abs = sums.min_nonzero;
  }
  out.sum += sums.sum;
  out.sum_sq += sums.sum_sq;
  if (nonfinite == 0 || out.first_nonfinite >= 0) return;
  for (int64_t i = run.offset; i < run.offset + run.length; ++i) {
    const float x = Elem::load(data[i]);
    if (std::isfinite(x)) continue;
    out.first_nonfinite = i;
    out.first_kind = std::isnan(x) ? NonfiniteKind::kNan
                     : x > 0       ? NonfiniteKind::kPosInf
                                   : NonfiniteKind::kNegInf;
    return;
  }
}

// Float accumulators of the fast path, one set per block of runs.
struct FastSums {
  float max_abs = 0.0f;
  float min_nonzero = kInf;  // kInf: no nonzero element yet
  float sum = 0.0f;
  float sum_sq = 0.0f;
};

// Adds one element to the accumulators. Branch-free: non-finite values flow
// through unchecked, poisoning sum_sq, which is what scan_fast checks.
inline void accumulate(float x, float& max_abs, float& min_nonzero, float& sum, float& sum_sq) {
  const float magnitude = std::fabs(x);
  max_abs = std::max(max_abs, magnitude);
  min_nonzero = std::min(min_nonzero, magnitude == 0.0f ? kInf : magnitude);
  sum += x;
  sum_sq += x * x;
}

// Accumulates one run. `omp simd` licenses the reordered (one partial result
// per vector lane) reductions that plain C++ semantics would forbid; the
// partial sums then cover at most kBlock / lanes elements each.
template <class Elem>
NANREPLAY_SIMD_CLONES void accumulate_run(const typename Elem::Raw* p, int64_t n, FastSums& sums) {
  const int64_t vector_part = n & ~(kSimdStep - 1);
  float max_abs = sums.max_abs, min_nonzero = sums.min_nonzero;
  float sum = sums.sum, sum_sq = sums.sum_sq;
#pragma omp simd reduction(max : max_abs) reduction(min : min_nonzero) reduction(+ : sum, sum_sq)
  for (int64_t i = 0; i < vector_part; ++i) {
    accumulate(Elem::load(p[i]), max_abs, min_nonzero, sum, sum_sq);
  }
  for (int64_t i = vector_part; i < n; ++i) {
    accumulate(Elem::load(p[i]), max_abs, min_nonzero, sum, sum_sq);
  }
  sums = FastSums{max_abs, min_nonzero, sum, sum_sq};
}

#ifdef NANREPLAY_F16C
bool f16c_available() {
  static const bool available = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return available;
}

// accumulate_run for f16 with F16C: the portable decode_f16 costs more than
// the statistics themselves (a third of the f32 throughput), so the
// conversion instruction runs inside the loop, two sets of eight float
// lanes. Same accumulators and semantics as accumulate(); only the grouping
// of the partial sums differs.
__attribute__((target("avx,f16c"))) void accumulate_run_f16c(const uint16_t* p, int64_t n, FastSums& sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(kInf);
  __m256 max_abs[2] = {zero, zero}, min_nonzero[2] = {inf, inf}, sum[2] = {zero, zero}, sum_sq[2] = {zero, zero};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 2; ++k) {
      const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 8 * k)));
      const __m256 magnitude = _mm256_andnot_ps(sign, x);
      max_abs[k] = _mm256_max_ps(magnitude, max_abs[k]);  // NaN keeps the accumulator, as std::max does
      // Zeros become inf (0 + inf; others + 0 are unchanged): arithmetic, not a
      // blend, which GCC 12 turns back into one branch per lane.
      const __m256 nonzero = _mm256_add_ps(magnitude, _mm256_and_ps(_mm256_cmp_ps(magnitude, zero, _CMP_EQ_OQ), inf));
      min_nonzero[k] = _mm256_min_ps(nonzero, min_nonzero[k]);
      sum[k] = _mm256_add_ps(sum[k], x);
      sum_sq[k] = _mm256_add_ps(sum_sq[k], _mm256_mul_ps(x, x));
    }
  }
  alignas(32) float lanes[4][16];
  _mm256_store_ps(lanes[0], max_abs[0]);
  _mm256_store_ps(lanes[0] + 8, max_abs[1]);
  _mm256_store_ps(lanes[1], min_nonzero[0]);
  _mm256_store_ps(lanes[1] + 8, min_nonzero[1]);
  _mm256_store_ps(lanes[2], sum[0]);
  _mm256_store_ps(lanes[2] + 8, sum[1]);
  _mm256_store_ps(lanes[3], sum_sq[0]);
  _mm256_store_ps(lanes[3] + 8, sum_sq[1]);
  float total = 0.0f, total_sq = 0.0f;
  for (int l = 0; l < 16; ++l) {
    sums.max_abs = std::max(sums.max_abs, lanes[0][l]);
    sums.min_nonzero = std::min(sums.min_nonzero, lanes[1][l]);
    total += lanes[2][l];
    total_sq += lanes[3][l];
  }
  sums.sum += total;
  sums.sum_sq += total_sq;
  for (; i < n; ++i) accumulate(decode_f16(p[i]), sums.max_abs, sums.min_nonzero, sums.sum, sums.sum_sq);
}
#endif

// Fast path over a group of runs (at most kBlock elements). Returns false,
// leaving `out` untouched, when the group holds a non-finite element (its
// float sum of squares is then inf or NaN), when finite squares overflowed
// float, or when all values are so tiny that float squares underflow; the
// caller then rescans the group with scan_exact.
template <class Elem>
bool scan_fast(const typename Elem::Raw* data, const Run* runs, int run_count, TensorStats& out) {
  FastSums sums;
  int64_t element_count = 0;
  for (int r = 0; r < run_count; ++r) {
#ifdef NANREPLAY_F16C
    if constexpr (std::is_same_v<Elem, F16Elem>) {
      if (f16c_available()) {
        accumulate_run_f16c(data + runs[r].offset, runs[r].length, sums);
        element_count += runs[r].length;
        continue;
      }
    }
#endif
    accumulate_run<Elem>(data + runs[r].offset, runs[r].length, sums);
    element_count += runs[r].length;
  }
  if (!std::isfinite(sums.sum_sq)) return false;
  if (sums.max_abs != 0.0f && sums.max_abs < kTinyMaxAbs) return false;

  out.count += element_count;
  out.finite_count += element_count;
  out.max_abs = std::max(out.max_abs, double{sums.max_abs});
  if (sums.min_nonzero != kInf &&
      (out.min_nonzero_abs == 0 || sums.min_nonzero < out.min_nonzero_abs)) {
    out.min_nonzero_abs = sums.min_nonzero;
  }
  out.sum += sums.sum;
  out.sum_sq += sums.sum_sq;
  return true;
}

template <class Elem>
void scan_group(const typename Elem::Raw* data, const Run* runs, int run_count, TensorStats& out) {
  if (scan_fast<Elem>(data, runs, run_count, out)) return;
  for (int r = 0; r < run_count; ++r) scan_exact<Elem>(data, runs[r], out);
}

// Statistics of the contiguous range [begin, end).
template <class Elem>
TensorStats scan_range(const typename Elem::Raw* data, int64_t begin, int64_t end) {
  TensorStats out;
  for (int64_t block = begin; block < end; block += kBlock) {
    const Run run{block, std::min(kBlock, end - block)};
    scan_group<Elem>(data, &run, 1, out);
  }
  return out;
}

// Statistics of the causal prefixes (cols span.first_key(row)..row: 0 for plain
// causal attention, row-W+1 with a sliding window W, the row's chunk start with
// chunked attention) of rows [row_begin, row_end)
// of one [rows, cols] matrix starting at `matrix_offset`. Short prefixes are
// gathered into groups of about kBlock elements for the fast path.
template <class Elem>
TensorStats scan_causal_rows(const typename Elem::Raw* data, int64_t matrix_offset, int64_t cols,
                             int64_t row_begin, int64_t row_end, const AttentionSpan& span) {
  TensorStats out;
  Run runs[kMaxRunsPerGroup];
  int run_count = 0;
  int64_t grouped = 0;
  auto flush = [&] {
    if (run_count > 0) scan_group<Elem>(data, runs, run_count, out);
    run_count = 0;
    grouped = 0;
  };
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t first_col = span.first_key(row);
    const int64_t row_offset = matrix_offset + row * cols + first_col;
    const int64_t length = std::min(row + 1, cols) - first_col;
    for (int64_t done = 0; done < length;) {
      const int64_t piece = std::min(length - done, kBlock - grouped);
      runs[run_count++] = Run{row_offset + done, piece};
      grouped += piece;
      done += piece;
      if (grouped == kBlock || run_count == kMaxRunsPerGroup) flush();
    }
  }
  flush();
  return out;
}

// Runs `task_count` independent tasks, in parallel when the work is large
// enough and we are not already inside a parallel region (probes may be taken
// from threaded code). Each task writes only its own slot.
template <class Task>
void run_tasks(int64_t task_count, int64_t total_elements, const Task& task) {
  const bool parallel = total_elements > kParallelThreshold && task_count > 1 &&
                        !omp_in_parallel() && omp_get_max_threads() > 1;
  if (!parallel) {
    for (int64_t t = 0; t < task_count; ++t) task(t);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < task_count; ++t) task(t);
}

template <class Elem>
TensorStats compute_stats_typed(const void* raw, int64_t numel) {
  const auto* data = static_cast<const typename Elem::Raw*>(raw);
  const int64_t chunk_count = (numel + kChunk - 1) / kChunk;
  if (chunk_count == 1) return scan_range<Elem>(data, 0, numel);
  std::vector<TensorStats> chunks(static_cast<size_t>(chunk_count));
  run_tasks(chunk_count, numel, [&](int64_t c) {
    chunks[c] = scan_range<Elem>(data, c * kChunk, std::min(numel, (c + 1) * kChunk));
  });
  TensorStats total;
  for (const TensorStats& chunk : chunks) total.merge(chunk);
  return total;
}

template <class Elem>
std::vector<TensorStats> compute_head_stats_typed(const void* raw, int64_t batch, int64_t heads,
                                                  int64_t rows, int64_t cols, bool causal,
                                                  const AttentionSpan& span) {
  const auto* data = static_cast<const typename Elem::Raw*>(raw);
  // Tasks are row ranges of one (batch, head) matrix, so a single huge head
  // still spreads over threads; merging them in (batch, row) order keeps each
  // head's first_nonfinite the lowest index.
  const int64_t rows_per_task =
      std::max<int64_t>(1, std::min(rows, kChunk / std::max<int64_t>(cols, 1)));
  const int64_t tasks_per_matrix = rows == 0 ? 0 : (rows + rows_per_task - 1) / rows_per_task;
  const int64_t task_count = batch * heads * tasks_per_matrix;
  std::vector<TensorStats> parts(static_cast<size_t>(task_count));
  run_tasks(task_count, batch * heads * rows * cols, [&](int64_t t) {
    const int64_t matrix = t / tasks_per_matrix;  // b * heads + h
    const int64_t row_begin = (t % tasks_per_matrix) * rows_per_task;
    const int64_t row_end = std::min(rows, row_begin + rows_per_task);
    const int64_t matrix_offset = matrix * rows * cols;
    parts[t] = causal ? scan_causal_rows<Elem>(data, matrix_offset, cols, row_begin, row_end, span)
                      : scan_range<Elem>(data, matrix_offset + row_begin * cols,
                                         matrix_offset + row_end * cols);
  });
  std::vector<TensorStats> per_head(static_cast<size_t>(heads));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t k = 0; k < tasks_per_matrix; ++k) {
        per_head[h].merge(parts[(b * heads + h) * tasks_per_matrix + k]);
      }
    }
  }
  return per_head;
}

}  // namespace

void TensorStats::merge(const TensorStats& later) {
  count += later.count;
  finite_count += later.finite_count;
  nan_count += later.nan_count;
  inf_count += later.inf_count;
  max_abs = std::max(max_abs, later.max_abs);
  if (later.min_nonzero_abs > 0 &&
      (min_nonzero_abs == 0 || later.min_nonzero_abs < min_nonzero_abs)) {
    min_nonzero_abs = later.min_nonzero_abs;
  }
  sum += later.sum;
  sum_sq += later.sum_sq;
  if (first_nonfinite < 0 && later.first_nonfinite >= 0) {
    first_nonfinite = later.first_nonfinite;
    first_kind = later.first_kind;
  }
}

TensorStats compute_stats(const void* data, ElemType type, int64_t numel) {
  if (numel < 0) throw std::invalid_argument("compute_stats: negative element count");
  if (numel == 0) return TensorStats{};
  switch (type) {
    case ElemType::kF32: return compute_stats_typed<F32Elem>(data, numel);
    case ElemType::kBF16: return compute_stats_typed<BF16Elem>(data, numel);
    case ElemType::kF16: return compute_stats_typed<F16Elem>(data, numel);
  }
  throw std::invalid_argument("compute_stats: unknown element type");
}

std::vector<TensorStats> compute_head_stats(const void* data, ElemType type, int64_t batch,
                                            int64_t heads, int64_t rows, int64_t cols,
                                            bool causal, const AttentionSpan& span) {
  if (batch < 0 || heads < 0 || rows < 0 || cols < 0) {
    throw std::invalid_argument("compute_head_stats: negative dimension");
  }
  if (causal && rows != cols) {
    throw std::invalid_argument("compute_head_stats: causal statistics need rows == cols");
  }
  if (!span.valid() || (!span.full() && !causal)) {
    throw std::invalid_argument("compute_head_stats: a window or chunk needs causal statistics and must be positive");
  }
  switch (type) {
    case ElemType::kF32:
      return compute_head_stats_typed<F32Elem>(data, batch, heads, rows, cols, causal, span);
    case ElemType::kBF16:
      return compute_head_stats_typed<BF16Elem>(data, batch, heads, rows, cols, causal, span);
    case ElemType::kF16:
      return compute_head_stats_typed<F16Elem>(data, batch, heads, rows, cols, causal, span);
  }
  throw std::invalid_argument("compute_head_stats: unknown element type");
}

TensorStats combine_heads(const std::vector<TensorStats>& per_head) {
  TensorStats total;
  for (const TensorStats& head : per_head) {
    total.merge(head);
    // Heads interleave in memory (batch-major), so the lowest index wins, not
    // the first head that has one.
    if (head.first_nonfinite >= 0 && head.first_nonfinite < total.first_nonfinite) {
      total.first_nonfinite = head.first_nonfinite;
      total.first_kind = head.first_kind;
    }
  }
  return total;
}

float bf16_to_float(uint16_t bits) { return decode_bf16(bits); }
float f16_to_float(uint16_t bits) { return decode_f16(bits); }

}  // namespace nanreplay
