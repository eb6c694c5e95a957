// Checks the fused statistics kernel (kernels/tensor_stats.cpp) against a plain
// scalar reference written here in double, on random f32/bf16/f16 data with NaN,
// +-inf, zeros and subnormals injected at random positions: sizes around the
// block boundaries, per-head and causal layouts, and sizes large enough to run
// on several threads. The decoders are checked on all 65536 bit patterns.
#include <omp.h>

#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/tensor_stats.h"
#include "tests/kernel_test_buffers.h"

namespace nanreplay {
namespace {

using namespace test;  // the shared test buffers and decoders

// --- The reference: one element at a time, in row-major order, in double.

struct Reference {
  TensorStats stats;
  double sum_abs = 0.0;  // scale for the tolerance on `sum`

  void add(int64_t index, float x) {
    ++stats.count;
    if (std::isnan(x) || std::isinf(x)) {
      (std::isnan(x) ? stats.nan_count : stats.inf_count) += 1;
      if (stats.first_nonfinite < 0) {
        stats.first_nonfinite = index;
        stats.first_kind = std::isnan(x) ? NonfiniteKind::kNan
                           : x > 0       ? NonfiniteKind::kPosInf
                                         : NonfiniteKind::kNegInf;
      }
      return;
    }
    const double v = x;
    ++stats.finite_count;
    stats.max_abs = std::max(stats.max_abs, std::fabs(v));
    if (v != 0 && (stats.min_nonzero_abs == 0 || std::fabs(v) < stats.min_nonzero_abs)) {
      stats.min_nonzero_abs = std::fabs(v);
    }
    stats.sum += v;
    stats.sum_sq += v * v;
    sum_abs += std::fabs(v);
  }
};

Reference reference_stats(const TestBuffer& buffer) {
  Reference ref;
  for (int64_t i = 0; i < buffer.size(); ++i) ref.add(i, buffer.value(i));
  return ref;
}

std::vector<Reference> reference_head_stats(const TestBuffer& buffer, int64_t batch, int64_t heads,
                                            int64_t rows, int64_t cols, bool causal) {
  std::vector<Reference> per_head(static_cast<size_t>(heads));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          if (causal && c > r) continue;
          const int64_t index = ((b * heads + h) * rows + r) * cols + c;
          per_head[size_t(h)].add(index, buffer.value(index));
        }
  return per_head;
}

// Counts, extremes and the first non-finite element exactly; sums to float
// partial-sum accuracy relative to the magnitudes involved.
void require_matches(const TensorStats& got, const Reference& want) {
  const TensorStats& w = want.stats;
  REQUIRE(got.count == w.count);
  REQUIRE(got.finite_count == w.finite_count);
  REQUIRE(got.nan_count == w.nan_count);
  REQUIRE(got.inf_count == w.inf_count);
  REQUIRE(got.first_nonfinite == w.first_nonfinite);
  REQUIRE(got.first_kind == w.first_kind);
  REQUIRE(got.max_abs == w.max_abs);
  REQUIRE(got.min_nonzero_abs == w.min_nonzero_abs);
  REQUIRE(std::fabs(got.sum - w.sum) <= 1e-5 * want.sum_abs + 1e-300);
  REQUIRE(std::fabs(got.sum_sq - w.sum_sq) <= 1e-5 * w.sum_sq + 1e-300);
}

void require_identical(const TensorStats& a, const TensorStats& b) {
  REQUIRE(a.count == b.count);
  REQUIRE(a.finite_count == b.finite_count);
  REQUIRE(a.nan_count == b.nan_count);
  REQUIRE(a.inf_count == b.inf_count);
  REQUIRE(a.first_nonfinite == b.first_nonfinite);
  REQUIRE(a.first_kind == b.first_kind);
  REQUIRE(a.max_abs == b.max_abs);
  REQUIRE(a.min_nonzero_abs == b.min_nonzero_abs);
  REQUIRE(a.sum == b.sum);
  REQUIRE(a.sum_sq == b.sum_sq);
}


// Restores the OpenMP thread count a test changed.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(omp_get_max_threads()) {}
  ~ThreadCountGuard() { omp_set_num_threads(saved_); }
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;

 private:
  int saved_;
};

}  // namespace

TEST_CASE("f16_to_float matches the format definition for all 65536 patterns", "[kernels]") {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float got = f16_to_float(uint16_t(bits)), want = reference_f16(uint16_t(bits));
    CAPTURE(bits);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(float_bits(got) == float_bits(want));  // also tells -0 from +0
    }
  }
}

TEST_CASE("bf16_to_float matches the format definition for all 65536 patterns", "[kernels]") {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float got = bf16_to_float(uint16_t(bits)), want = reference_bf16(uint16_t(bits));
    CAPTURE(bits);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(float_bits(got) == float_bits(want));
    }
  }
}

TEST_CASE("nonfinite_kind_name spells the report's kinds", "[kernels]") {
  REQUIRE(std::string(nonfinite_kind_name(NonfiniteKind::kNan)) == "nan");
  REQUIRE(std::string(nonfinite_kind_name(NonfiniteKind::kPosInf)) == "inf");
  REQUIRE(std::string(nonfinite_kind_name(NonfiniteKind::kNegInf)) == "-inf");
  REQUIRE(std::string(nonfinite_kind_name(NonfiniteKind::kNone)) == "none");
}

TEST_CASE("compute_stats matches the reference around block boundaries", "[kernels]") {
  // The fast path works in blocks of 4096 and vector steps of 16 elements.
  const int64_t sizes[] = {0,    1,    2,    15,   16,   17,   31,    32,   33,   63,
                           64,   65,   1023, 1024, 1025, 2047, 2048,  4095, 4096, 4097,
                           4111, 4112, 4113, 8191, 8192, 8193, 12289, 65537};
  const Injection injections[] = {{0.0, false}, {0.02, false}, {2e-4, true}, {0.05, true}};
  uint32_t seed = 1;
  for (ElemType type : kAllTypes) {
    for (int64_t n : sizes) {
      for (const Injection& injection : injections) {
        CAPTURE(type_name(type), n, injection.rate, injection.nonfinite, seed);
        const TestBuffer buffer = make_buffer(type, n, seed++, injection);
        require_matches(compute_stats(buffer.data(), type, n), reference_stats(buffer));
      }
    }
  }
}

TEST_CASE("compute_stats finds a lone non-finite element at every position", "[kernels]") {
  const Special kinds[] = {Special::kNan, Special::kPosInf, Special::kNegInf};
  const NonfiniteKind expected[] = {NonfiniteKind::kNan, NonfiniteKind::kPosInf,
                                    NonfiniteKind::kNegInf};
  for (ElemType type : kAllTypes) {
    for (int64_t n : {int64_t{97}, int64_t{2100}}) {
      TestBuffer buffer = make_buffer(type, n, 11, {0.0, false});
      std::mt19937 rng(5);
      const int64_t stride = n > 100 ? 7 : 1;
      for (int64_t position = 0; position < n; position += stride) {
        for (int k = 0; k < 3; ++k) {
          TestBuffer probe = buffer;
          probe.set_special(position, kinds[k], rng);
          const TensorStats stats = compute_stats(probe.data(), type, n);
          CAPTURE(type_name(type), n, position, k);
          REQUIRE(stats.first_nonfinite == position);
          REQUIRE(stats.first_kind == expected[k]);
          REQUIRE(stats.nan_count + stats.inf_count == 1);
          REQUIRE(stats.finite_count == n - 1);
        }
      }
    }
  }
}

TEST_CASE("compute_stats on large buffers matches the reference on any thread count", "[kernels]") {
  ThreadCountGuard guard;
  const int64_t n = 3'000'017;  // > 1M elements: threaded, chunk tail uneven
  for (ElemType type : kAllTypes) {
    for (const Injection& injection : {Injection{0.0, false}, Injection{1e-6, true}}) {
      CAPTURE(type_name(type), injection.rate);
      TestBuffer buffer = make_buffer(type, n, 77, injection);
      // Without random injection the only non-finite values lie late in the
      // buffer: the earliest must win the in-order merge of the chunks.
      std::mt19937 rng(3);
      buffer.set_special(n - 5, Special::kNegInf, rng);
      buffer.set_special(2'500'000, Special::kNan, rng);
      const Reference want = reference_stats(buffer);
      omp_set_num_threads(1);
      const TensorStats serial = compute_stats(buffer.data(), type, n);
      omp_set_num_threads(4);
      const TensorStats threaded = compute_stats(buffer.data(), type, n);
      require_matches(threaded, want);
      require_identical(serial, threaded);  // chunking is by size, not by thread
    }
  }
}

TEST_CASE("compute_stats stays accurate for extreme magnitudes", "[kernels]") {
  const int64_t n = 5000;
  auto constant_buffer = [&](float value) { return std::vector<float>(size_t(n), value); };

  SECTION("squares beyond float range") {
    const std::vector<float> data = constant_buffer(3e30f);
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.all_finite());
    REQUIRE(stats.sum_sq == Approx(double(n) * double(3e30f) * double(3e30f)).epsilon(1e-12));
    REQUIRE(stats.rms() == Approx(double(3e30f)).epsilon(1e-12));
  }
  SECTION("largest finite values") {
    const std::vector<float> data = constant_buffer(-FLT_MAX);
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.all_finite());
    REQUIRE(stats.max_abs == double(FLT_MAX));
    REQUIRE(stats.mean() == Approx(-double(FLT_MAX)).epsilon(1e-12));
  }
  SECTION("squares below float range") {
    const std::vector<float> data = constant_buffer(1e-30f);
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.rms() == Approx(double(1e-30f)).epsilon(1e-12));
    REQUIRE(stats.min_nonzero_abs == double(1e-30f));
  }
  SECTION("subnormals only") {
    const float tiny = std::numeric_limits<float>::denorm_min();
    const std::vector<float> data = constant_buffer(tiny);
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.min_nonzero_abs == double(tiny));
    REQUIRE(stats.sum == Approx(double(n) * double(tiny)).epsilon(1e-12));
    REQUIRE(stats.sum_sq == Approx(double(n) * double(tiny) * double(tiny)).epsilon(1e-12));
  }
  SECTION("all zeros") {
    const std::vector<float> data = constant_buffer(0.0f);
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.finite_count == n);
    REQUIRE(stats.max_abs == 0.0);
    REQUIRE(stats.min_nonzero_abs == 0.0);
    REQUIRE(stats.rms() == 0.0);
  }
  SECTION("only non-finite") {
    const std::vector<float> data = constant_buffer(-std::numeric_limits<float>::infinity());
    const TensorStats stats = compute_stats(data.data(), ElemType::kF32, n);
    REQUIRE(stats.inf_count == n);
    REQUIRE(stats.finite_count == 0);
    REQUIRE(stats.first_nonfinite == 0);
    REQUIRE(stats.first_kind == NonfiniteKind::kNegInf);
    REQUIRE(stats.max_abs == 0.0);
    REQUIRE(stats.mean() == 0.0);
    REQUIRE(stats.rms() == 0.0);
  }
}

TEST_CASE("compute_head_stats matches the per-head reference", "[kernels]") {
  struct Shape {
    int64_t batch, heads, rows, cols;
  };
  const Shape shapes[] = {{2, 3, 37, 37}, {1, 4, 130, 130}, {3, 2, 5, 1100},
                          {2, 1, 1, 1},   {1, 2, 0, 0},     {2, 2, 33, 33}};
  const Injection injections[] = {{0.01, false}, {5e-4, true}, {0.05, true}};
  uint32_t seed = 100;
  for (ElemType type : kAllTypes) {
    for (const Shape& s : shapes) {
      for (bool causal : {false, true}) {
        if (causal && s.rows != s.cols) continue;
        for (const Injection& injection : injections) {
          CAPTURE(type_name(type), s.batch, s.heads, s.rows, s.cols, causal, injection.rate);
          const int64_t n = s.batch * s.heads * s.rows * s.cols;
          const TestBuffer buffer = make_buffer(type, n, seed++, injection);
          const std::vector<TensorStats> got =
              compute_head_stats(buffer.data(), type, s.batch, s.heads, s.rows, s.cols, causal);
          const std::vector<Reference> want =
              reference_head_stats(buffer, s.batch, s.heads, s.rows, s.cols, causal);
          REQUIRE(got.size() == want.size());
          for (size_t h = 0; h < got.size(); ++h) {
            CAPTURE(h);
            require_matches(got[h], want[h]);
          }
        }
      }
    }
  }
}

TEST_CASE("compute_head_stats on large causal heads splits rows over threads", "[kernels]") {
  ThreadCountGuard guard;
  struct Shape {
    int64_t batch, heads, rows;
  };
  // 4.5M elements with many matrices, then one matrix of 4.4M elements whose
  // rows must be split into several tasks.
  for (const Shape& s : {Shape{2, 2, 1500}, Shape{1, 1, 2100}}) {
    for (ElemType type : kAllTypes) {
      CAPTURE(type_name(type), s.batch, s.heads, s.rows);
      const int64_t n = s.batch * s.heads * s.rows * s.rows;
      TestBuffer buffer = make_buffer(type, n, 9, {2e-6, true});
      const std::vector<Reference> want =
          reference_head_stats(buffer, s.batch, s.heads, s.rows, s.rows, true);
      omp_set_num_threads(1);
      const std::vector<TensorStats> serial =
          compute_head_stats(buffer.data(), type, s.batch, s.heads, s.rows, s.rows, true);
      omp_set_num_threads(4);
      const std::vector<TensorStats> threaded =
          compute_head_stats(buffer.data(), type, s.batch, s.heads, s.rows, s.rows, true);
      for (size_t h = 0; h < want.size(); ++h) {
        CAPTURE(h);
        require_matches(threaded[h], want[h]);
        require_identical(serial[h], threaded[h]);
      }
    }
  }
}

TEST_CASE("compute_head_stats ignores what the causal mask removes", "[kernels]") {
  const int64_t batch = 2, heads = 3, rows = 70;
  for (ElemType type : kAllTypes) {
    CAPTURE(type_name(type));
    TestBuffer buffer = make_buffer(type, batch * heads * rows * rows, 21, {0.0, false});
    std::mt19937 rng(1);
    // Scores as a masked softmax input sees them: -inf (and stray NaN) above
    // the diagonal, finite below.
    for (int64_t m = 0; m < batch * heads; ++m)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = r + 1; c < rows; ++c)
          buffer.set_special((m * rows + r) * rows + c,
                             (r + c) % 9 == 0 ? Special::kNan : Special::kNegInf, rng);
    const std::vector<TensorStats> causal =
        compute_head_stats(buffer.data(), type, batch, heads, rows, rows, true);
    for (const TensorStats& head : causal) {
      REQUIRE(head.all_finite());
      REQUIRE(head.first_nonfinite == -1);
      REQUIRE(head.count == batch * rows * (rows + 1) / 2);
    }
    // Without the mask the same buffer is full of -inf, first at (0, 0, 0, 1).
    const std::vector<TensorStats> full =
        compute_head_stats(buffer.data(), type, batch, heads, rows, rows, false);
    REQUIRE(full[0].first_nonfinite == 1);
    REQUIRE(full[0].first_kind == NonfiniteKind::kNegInf);
    REQUIRE(full[1].first_nonfinite == rows * rows + 1);
  }
}

TEST_CASE("compute_head_stats with a sliding window counts only the keys each query sees", "[kernels]") {
  const int64_t batch = 2, heads = 2, rows = 40, window = 7;
  for (ElemType type : kAllTypes) {
    CAPTURE(type_name(type));
    TestBuffer buffer = make_buffer(type, batch * heads * rows * rows, 5, {0.0, false});
    std::mt19937 rng(3);
    // Outside the window (and above the diagonal) the matrix holds NaN: none may be counted.
    for (int64_t m = 0; m < batch * heads; ++m)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < rows; ++c)
          if (c > r || r - c >= window) buffer.set_special((m * rows + r) * rows + c, Special::kNan, rng);
    int64_t visible = 0;
    for (int64_t r = 0; r < rows; ++r) visible += std::min(r + 1, window);
    const std::vector<TensorStats> windowed =
        compute_head_stats(buffer.data(), type, batch, heads, rows, rows, true, window);
    for (const TensorStats& head : windowed) {
      REQUIRE(head.all_finite());
      REQUIRE(head.count == batch * visible);
    }
    // The plain causal view sees the NaN below the window, first at row `window`, col 0.
    const std::vector<TensorStats> causal = compute_head_stats(buffer.data(), type, batch, heads, rows, rows, true);
    REQUIRE(causal[0].first_nonfinite == window * rows);
    REQUIRE_THROWS_AS(compute_head_stats(buffer.data(), type, batch, heads, rows, rows, false, window),
                      std::invalid_argument);
  }
}

TEST_CASE("compute_head_stats rejects impossible layouts", "[kernels]") {
  const std::vector<float> data(64, 1.0f);
  REQUIRE_THROWS_AS(compute_head_stats(data.data(), ElemType::kF32, 1, 1, 4, 16, true),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(compute_head_stats(data.data(), ElemType::kF32, -1, 1, 8, 8, false),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(compute_stats(data.data(), ElemType::kF32, -1), std::invalid_argument);
}

TEST_CASE("combine_heads takes the lowest index over heads", "[kernels]") {
  const int64_t batch = 2, heads = 3, rows = 8, cols = 8;
  TestBuffer buffer = make_buffer(ElemType::kF32, batch * heads * rows * cols, 4, {0.01, false});
  std::mt19937 rng(2);
  auto index = [&](int64_t b, int64_t h, int64_t r, int64_t c) {
    return ((b * heads + h) * rows + r) * cols + c;
  };
  // Head 2 goes bad in batch row 0; head 0 only in batch row 1, which lies
  // later in memory although head 0 comes first.
  buffer.set_special(index(1, 0, 0, 0), Special::kNan, rng);
  buffer.set_special(index(0, 2, 3, 1), Special::kPosInf, rng);
  const std::vector<TensorStats> per_head =
      compute_head_stats(buffer.data(), ElemType::kF32, batch, heads, rows, cols, false);
  REQUIRE(per_head[0].first_nonfinite == index(1, 0, 0, 0));
  REQUIRE(per_head[2].first_nonfinite == index(0, 2, 3, 1));

  const TensorStats combined = combine_heads(per_head);
  REQUIRE(combined.first_nonfinite == index(0, 2, 3, 1));
  REQUIRE(combined.first_kind == NonfiniteKind::kPosInf);
  require_matches(combined, reference_stats(buffer));
}

TEST_CASE("TensorStats::merge folds later statistics in", "[kernels]") {
  TensorStats early, late;
  early.count = early.finite_count = 2;
  early.max_abs = 3.0;
  early.min_nonzero_abs = 0.0;  // no nonzero element yet
  early.sum = 3.0;
  early.sum_sq = 9.0;
  late.count = 3;
  late.finite_count = 2;
  late.nan_count = 1;
  late.max_abs = 2.0;
  late.min_nonzero_abs = 0.5;
  late.sum = -1.5;
  late.sum_sq = 4.25;
  late.first_nonfinite = 9;
  late.first_kind = NonfiniteKind::kNan;

  TensorStats merged = early;
  merged.merge(late);
  REQUIRE(merged.count == 5);
  REQUIRE(merged.finite_count == 4);
  REQUIRE(merged.nan_count == 1);
  REQUIRE(merged.max_abs == 3.0);
  REQUIRE(merged.min_nonzero_abs == 0.5);
  REQUIRE(merged.mean() == Approx(1.5 / 4));
  REQUIRE(merged.rms() == Approx(std::sqrt(13.25 / 4)));
  REQUIRE(merged.first_nonfinite == 9);

  // An earlier non-finite element is never replaced by a later one.
  TensorStats later_bad = late;
  later_bad.first_nonfinite = 20;
  later_bad.first_kind = NonfiniteKind::kNegInf;
  merged.merge(later_bad);
  REQUIRE(merged.first_nonfinite == 9);
  REQUIRE(merged.first_kind == NonfiniteKind::kNan);

  REQUIRE(TensorStats{}.mean() == 0.0);
  REQUIRE(TensorStats{}.rms() == 0.0);
}

}  // namespace nanreplay
