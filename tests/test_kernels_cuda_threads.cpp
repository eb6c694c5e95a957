// The CUDA statistics kernels' per-thread code (kernels/tensor_stats_cuda_threads.h)
// run on the host: every thread of the grid a launch would use, in turn, with
// the partial results merged, against the CPU kernel on the shared test
// buffers. Runs everywhere (no GPU, no nvcc needed), so the index arithmetic,
// the alignment prologue, the vector fast path and its fallback, and the
// causal row ranges are checked in CI; the host build of load_vector throws
// on a misaligned 16-byte load, which on a GPU would fault. The device itself
// is tested by tests/gpu/ where one is present.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/tensor_stats.h"
#include "kernels/tensor_stats_cuda_threads.h"
#include "tests/kernel_test_buffers.h"

namespace nanreplay {
namespace {

using cuda::threads::Accumulator;
using test::Injection;
using test::kAllTypes;
using test::make_buffer;
using test::Special;
using test::TestBuffer;
using test::type_name;

template <class Elem>
TensorStats emulate_whole(const void* data, int64_t numel) {
  const auto* raw = static_cast<const typename Elem::Raw*>(data);
  const int64_t blocks = cuda::threads::whole_blocks(numel);
  Accumulator total = cuda::threads::empty_accumulator();
  for (int64_t block = 0; block < blocks; ++block) {
    for (int thread = 0; thread < cuda::threads::kThreads; ++thread) {
      Accumulator a = cuda::threads::empty_accumulator();
      cuda::threads::whole_thread<Elem>(raw, numel, blocks, block, thread, a);
      cuda::threads::merge(total, a);
    }
  }
  return cuda::threads::to_tensor_stats(total);
}

template <class Elem>
std::vector<TensorStats> emulate_heads(const void* data, int64_t batch, int64_t heads, int64_t rows,
                                       int64_t cols, bool causal) {
  const auto* raw = static_cast<const typename Elem::Raw*>(data);
  const int64_t blocks = cuda::threads::head_blocks(batch, heads, rows, cols);
  std::vector<TensorStats> out;
  for (int64_t head = 0; head < heads; ++head) {
    Accumulator total = cuda::threads::empty_accumulator();
    for (int64_t block = 0; block < blocks; ++block) {
      for (int thread = 0; thread < cuda::threads::kThreads; ++thread) {
        Accumulator a = cuda::threads::empty_accumulator();
        cuda::threads::head_thread<Elem>(raw, batch, heads, rows, cols, causal, head, blocks, block,
                                         thread, a);
        cuda::threads::merge(total, a);
      }
    }
    out.push_back(cuda::threads::to_tensor_stats(total));
  }
  return out;
}

TensorStats whole(ElemType type, const void* data, int64_t numel) {
  switch (type) {
    case ElemType::kF32: return emulate_whole<cuda::threads::F32Elem>(data, numel);
    case ElemType::kBF16: return emulate_whole<cuda::threads::BF16Elem>(data, numel);
    case ElemType::kF16: return emulate_whole<cuda::threads::F16Elem>(data, numel);
  }
  throw std::logic_error("unknown type");
}

std::vector<TensorStats> per_head(ElemType type, const void* data, int64_t batch, int64_t heads,
                                  int64_t rows, int64_t cols, bool causal) {
  switch (type) {
    case ElemType::kF32:
      return emulate_heads<cuda::threads::F32Elem>(data, batch, heads, rows, cols, causal);
    case ElemType::kBF16:
      return emulate_heads<cuda::threads::BF16Elem>(data, batch, heads, rows, cols, causal);
    case ElemType::kF16:
      return emulate_heads<cuda::threads::F16Elem>(data, batch, heads, rows, cols, causal);
  }
  throw std::logic_error("unknown type");
}

// Counts, extremes and the first non-finite element exactly; sums to the
// rounding of float partial sums.
void require_agrees(const TensorStats& got, const TensorStats& cpu) {
  REQUIRE(got.count == cpu.count);
  REQUIRE(got.finite_count == cpu.finite_count);
  REQUIRE(got.nan_count == cpu.nan_count);
  REQUIRE(got.inf_count == cpu.inf_count);
  REQUIRE(got.first_nonfinite == cpu.first_nonfinite);
  REQUIRE(got.first_kind == cpu.first_kind);
  REQUIRE(got.max_abs == cpu.max_abs);
  REQUIRE(got.min_nonzero_abs == cpu.min_nonzero_abs);
  REQUIRE(std::fabs(got.sum_sq - cpu.sum_sq) <= 1e-5 * cpu.sum_sq + 1e-300);
  REQUIRE(std::fabs(got.sum - cpu.sum) <= 1e-5 * std::sqrt(cpu.sum_sq * double(cpu.finite_count)) + 1e-300);
}


size_t width(ElemType type) { return type == ElemType::kF32 ? 4 : 2; }

}  // namespace

TEST_CASE("CUDA threads, run on the host, match the CPU kernel on whole buffers at any alignment",
          "[kernels][cuda]") {
  const int64_t sizes[] = {0, 1, 3, 7, 8, 9, 17, 4095, 65'537, 300'001};
  const Injection injections[] = {{0.0, false}, {0.02, false}, {2e-4, true}, {0.05, true}};
  uint32_t seed = 1;
  for (ElemType type : kAllTypes) {
    for (int64_t n : sizes) {
      for (const Injection& injection : injections) {
        // Eight spare elements in front: every offset from a 16-byte boundary.
        const TestBuffer buffer = make_buffer(type, n + 8, seed++, injection);
        for (int offset = 0; offset < 8; ++offset) {
          CAPTURE(type_name(type), n, injection.rate, injection.nonfinite, offset);
          const void* data = static_cast<const char*>(buffer.data()) + offset * width(type);
          require_agrees(whole(type, data, n), compute_stats(data, type, n));
        }
      }
    }
  }
}

TEST_CASE("CUDA threads, run on the host, find a lone non-finite element wherever it is",
          "[kernels][cuda]") {
  const Special kinds[] = {Special::kNan, Special::kPosInf, Special::kNegInf};
  std::mt19937 rng(5);
  for (ElemType type : kAllTypes) {
    const int64_t n = 100'003;
    for (int64_t position : {int64_t{0}, int64_t{5}, int64_t{4096}, int64_t{65'536}, n - 1}) {
      for (int k = 0; k < 3; ++k) {
        CAPTURE(type_name(type), position, k);
        TestBuffer buffer = make_buffer(type, n, 11, {0.0, false});
        buffer.set_special(position, kinds[k], rng);
        if (position < n - 1) buffer.set_special(n - 1, Special::kNan, rng);
        const TensorStats got = whole(type, buffer.data(), n);
        REQUIRE(got.first_nonfinite == position);
        require_agrees(got, compute_stats(buffer.data(), type, n));
      }
    }
  }
}

TEST_CASE("CUDA threads, run on the host, match the CPU kernel per head, causal or not",
          "[kernels][cuda]") {
  struct Shape {
    int64_t batch, heads, rows, cols;
  };
  const Shape shapes[] = {{1, 1, 1, 1},     {2, 3, 5, 5},     {2, 4, 64, 64}, {3, 8, 33, 33},
                          {1, 2, 300, 300}, {2, 5, 17, 64}, {1, 3, 7, 9}};
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
              per_head(type, buffer.data(), s.batch, s.heads, s.rows, s.cols, causal);
          const std::vector<TensorStats> cpu =
              compute_head_stats(buffer.data(), type, s.batch, s.heads, s.rows, s.cols, causal);
          REQUIRE(got.size() == cpu.size());
          for (size_t h = 0; h < got.size(); ++h) {
            CAPTURE(h);
            require_agrees(got[h], cpu[h]);
          }
        }
      }
    }
  }
}

TEST_CASE("CUDA threads' host build refuses a misaligned vector load", "[kernels][cuda]") {
  alignas(16) const uint32_t words[8] = {};
  const auto* aligned = reinterpret_cast<const cuda::threads::Vector16*>(words);
  REQUIRE_NOTHROW(cuda::threads::load_vector(aligned));
  const auto* misaligned = reinterpret_cast<const cuda::threads::Vector16*>(words + 1);
  REQUIRE_THROWS_AS(cuda::threads::load_vector(misaligned), std::logic_error);
}

TEST_CASE("CUDA launch geometry depends on the shape only", "[kernels][cuda]") {
  CHECK(cuda::threads::whole_blocks(0) == 1);
  CHECK(cuda::threads::whole_blocks(1) == 1);
  CHECK(cuda::threads::whole_blocks(int64_t{1} << 34) == cuda::threads::kMaxWholeBlocks);
  CHECK(cuda::threads::head_blocks(8, 16, 2048, 2048) * 16 <= cuda::threads::kMaxPartials);
  CHECK(cuda::threads::head_blocks(1, cuda::threads::kMaxPartials, 1, 1) == 1);
}

}  // namespace nanreplay
