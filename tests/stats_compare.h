// One probe's statistics from two implementations (CPU kernel, LibTorch
// reductions, CUDA kernel): counts, extrema and the first non-finite element
// exactly, sums to rounding (each implementation folds them in its own order).
#pragma once

#include <catch2/catch.hpp>

#include "kernels/tensor_stats.h"

namespace nanreplay_test {

inline void check_same_stats(const nanreplay::TensorStats& measured, const nanreplay::TensorStats& reference,
                             double sum_margin = 1e-6, double sum_sq_margin = 0.0) {
  CHECK(measured.count == reference.count);
  CHECK(measured.finite_count == reference.finite_count);
  CHECK(measured.nan_count == reference.nan_count);
  CHECK(measured.inf_count == reference.inf_count);
  CHECK(measured.max_abs == reference.max_abs);
  CHECK(measured.min_nonzero_abs == reference.min_nonzero_abs);
  CHECK(measured.first_nonfinite == reference.first_nonfinite);
  CHECK(measured.first_kind == reference.first_kind);
  // The CPU kernel accumulates f32 blocks in float before folding them into double.
  CHECK(measured.sum == Approx(reference.sum).epsilon(1e-5).margin(sum_margin));
  CHECK(measured.sum_sq == Approx(reference.sum_sq).epsilon(1e-5).margin(sum_sq_margin));
}

}  // namespace nanreplay_test
