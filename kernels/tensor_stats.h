// The fused single-pass statistics kernel behind every probe: in one read of
// the buffer it gathers max |x| and min nonzero |x| over the finite elements,
// their sum and sum of squares, NaN and Inf counts and the row-major index of
// the first non-finite element. No LibTorch here: raw buffers in, plain data out.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/attention_span.h"

namespace nanreplay {

enum class ElemType { kF32, kBF16, kF16 };

enum class NonfiniteKind { kNone, kNan, kPosInf, kNegInf };
// Inline, like mean() and rms() below: the trace reader (and its fuzz target)
// uses them without linking the kernels.
inline const char* nonfinite_kind_name(NonfiniteKind kind) {  // "nan", "inf", "-inf", "none"
  switch (kind) {
    case NonfiniteKind::kNan: return "nan";
    case NonfiniteKind::kPosInf: return "inf";
    case NonfiniteKind::kNegInf: return "-inf";
    case NonfiniteKind::kNone: break;
  }
  return "none";
}

struct TensorStats {
  int64_t count = 0;          // elements considered (causal-masked ones excluded)
  int64_t finite_count = 0;
  int64_t nan_count = 0;
  int64_t inf_count = 0;      // +inf and -inf together
  double max_abs = 0.0;       // over finite elements; 0 when none
  double min_nonzero_abs = 0.0;  // over finite nonzero elements; 0 when none
  double sum = 0.0;           // over finite elements
  double sum_sq = 0.0;        // over finite elements
  int64_t first_nonfinite = -1;  // row-major index in the full buffer, -1 if none
  NonfiniteKind first_kind = NonfiniteKind::kNone;

  bool all_finite() const { return nan_count == 0 && inf_count == 0; }
  double mean() const { return finite_count > 0 ? sum / double(finite_count) : 0.0; }  // 0 when none
  double rms() const { return finite_count > 0 ? std::sqrt(sum_sq / double(finite_count)) : 0.0; }
  // Folds `later` (covering elements after this one's in row-major order) in.
  void merge(const TensorStats& later);
};

// The coordinates in `shape` of row-major element `index` (first_nonfinite's
// element, a changed parameter element).
inline std::vector<int64_t> unravel(int64_t index, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coords(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) return coords;
    coords[d] = index % shape[d];
    index /= shape[d];
  }
  return coords;
}

// Whole-buffer statistics of `numel` elements.
TensorStats compute_stats(const void* data, ElemType type, int64_t numel);

// Per-head statistics of a contiguous [batch, heads, rows, cols] buffer:
// result[h] covers head h over every batch row. With `causal`, only elements
// with col <= row count (requires rows == cols), and with a sliding window
// or chunks in `span` only the cols it lets each row see; masked elements are skipped
// entirely (not counted, not checked). Indices are row-major over the full buffer.
std::vector<TensorStats> compute_head_stats(const void* data, ElemType type, int64_t batch,
                                            int64_t heads, int64_t rows, int64_t cols,
                                            bool causal, const AttentionSpan& span = {});

// Combines per-head results into whole-tensor statistics whose
// first_nonfinite is the lowest index over all heads.
TensorStats combine_heads(const std::vector<TensorStats>& per_head);

// Conversions used by the kernel (exact, round-to-nearest-even for narrowing).
float bf16_to_float(uint16_t bits);
float f16_to_float(uint16_t bits);

}  // namespace nanreplay
