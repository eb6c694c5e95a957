// The CUDA statistics kernel against the CPU kernel on the same data: every
// dtype, NaN and +-inf planted at random and at chosen positions, aligned and
// misaligned buffers, whole and per-head (causal and not) layouts, many
// requests collected at once. Counts, extremes and the first non-finite
// element must agree exactly; sums to rounding (the CPU sums floats per
// 4096-element block, the GPU sums doubles). Tagged [gpu]; the runner in
// gpu_main.cpp skips the whole executable (exit 77) when there is no device.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/tensor_stats.h"
#include "kernels/tensor_stats_cuda.h"
#include "tests/kernel_test_buffers.h"

namespace nanreplay {
namespace {

using test::Injection;
using test::make_buffer;
using test::Special;
using test::TestBuffer;
using test::type_name;

size_t element_size(ElemType type) { return type == ElemType::kF32 ? 4 : 2; }

// A copy of a host buffer in device memory, `offset_elements` past a
// 256-byte aligned allocation (1 makes the vector loads impossible).
class DeviceCopy {
 public:
  DeviceCopy(const TestBuffer& buffer, int64_t offset_elements = 0) {
    const size_t width = element_size(buffer.type);
    const size_t bytes = static_cast<size_t>(buffer.size()) * width;
    const size_t offset = static_cast<size_t>(offset_elements) * width;
    if (cudaMalloc(&base_, bytes + offset + 1) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    data_ = static_cast<char*>(base_) + offset;
    if (bytes > 0 && cudaMemcpy(data_, buffer.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy");
    }
  }
  ~DeviceCopy() { cudaFree(base_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  const void* data() const { return data_; }

 private:
  void* base_ = nullptr;
  void* data_ = nullptr;
};

// Sum of |x| over the finite elements of `indices`: the scale of `sum`'s rounding.
double finite_abs_sum(const TestBuffer& buffer, const std::vector<int64_t>& indices) {
  double total = 0.0;
  for (int64_t i : indices) {
    const float x = buffer.value(i);
    if (std::isfinite(x)) total += std::fabs(double(x));
  }
  return total;
}

std::vector<int64_t> all_indices(int64_t n) {
  std::vector<int64_t> indices(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) indices[size_t(i)] = i;
  return indices;
}

void require_agrees(const TensorStats& gpu, const TensorStats& cpu, double abs_sum) {
  REQUIRE(gpu.count == cpu.count);
  REQUIRE(gpu.finite_count == cpu.finite_count);
  REQUIRE(gpu.nan_count == cpu.nan_count);
  REQUIRE(gpu.inf_count == cpu.inf_count);
  REQUIRE(gpu.first_nonfinite == cpu.first_nonfinite);
  REQUIRE(gpu.first_kind == cpu.first_kind);
  REQUIRE(gpu.max_abs == cpu.max_abs);
  REQUIRE(gpu.min_nonzero_abs == cpu.min_nonzero_abs);
  REQUIRE(std::fabs(gpu.sum - cpu.sum) <= 1e-5 * abs_sum + 1e-300);
  REQUIRE(std::fabs(gpu.sum_sq - cpu.sum_sq) <= 1e-5 * cpu.sum_sq + 1e-300);
}

TensorStats gpu_stats(const TestBuffer& buffer, int64_t offset_elements = 0) {
  const DeviceCopy copy(buffer, offset_elements);
  cuda::DeviceStatsBuffer results(1);
  results.add(copy.data(), buffer.type, buffer.size());
  return results.collect().at(0);
}

const ElemType kAllTypes[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF16};

}  // namespace

TEST_CASE("CUDA compute matches the CPU kernel on whole buffers", "[gpu]") {
  const int64_t sizes[] = {0, 1, 7, 8, 9, 4095, 4096, 4097, 65'537, 1'000'003, 6'000'000};
  const Injection injections[] = {{0.0, false}, {0.02, false}, {2e-4, true}, {0.05, true}};
  uint32_t seed = 1;
  for (ElemType type : kAllTypes) {
    for (int64_t n : sizes) {
      for (const Injection& injection : injections) {
        for (int64_t offset : {0, 1}) {
          CAPTURE(type_name(type), n, injection.rate, injection.nonfinite, offset);
          const TestBuffer buffer = make_buffer(type, n, seed++, injection);
          const TensorStats cpu = compute_stats(buffer.data(), type, n);
          require_agrees(gpu_stats(buffer, offset), cpu, finite_abs_sum(buffer, all_indices(n)));
        }
      }
    }
  }
}

TEST_CASE("CUDA compute finds a lone non-finite element wherever it is", "[gpu]") {
  const Special kinds[] = {Special::kNan, Special::kPosInf, Special::kNegInf};
  std::mt19937 rng(5);
  for (ElemType type : kAllTypes) {
    const int64_t n = 300'001;
    for (int64_t position : {int64_t{0}, int64_t{3}, int64_t{4096}, int64_t{131'071}, n - 1}) {
      for (int k = 0; k < 3; ++k) {
        CAPTURE(type_name(type), position, k);
        TestBuffer buffer = make_buffer(type, n, 11, {0.0, false});
        buffer.set_special(position, kinds[k], rng);
        if (position < n - 1) buffer.set_special(n - 1, Special::kNan, rng);  // a later one
        const TensorStats gpu = gpu_stats(buffer);
        const TensorStats cpu = compute_stats(buffer.data(), type, n);
        REQUIRE(gpu.first_nonfinite == position);
        require_agrees(gpu, cpu, finite_abs_sum(buffer, all_indices(n)));
      }
    }
  }
}

TEST_CASE("CUDA per-head statistics match the CPU kernel, causal or not", "[gpu]") {
  struct Shape {
    int64_t batch, heads, rows, cols;
  };
  const Shape shapes[] = {{1, 1, 1, 1}, {2, 3, 5, 5}, {2, 4, 64, 64}, {3, 8, 130, 130},
                          {1, 2, 1024, 1024}, {2, 5, 17, 64}};
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
          const DeviceCopy copy(buffer);
          cuda::DeviceStatsBuffer results(s.heads);
          REQUIRE(results.add_heads(copy.data(), type, s.batch, s.heads, s.rows, s.cols, causal) == 0);
          const std::vector<TensorStats> gpu = results.collect();
          const std::vector<TensorStats> cpu =
              compute_head_stats(buffer.data(), type, s.batch, s.heads, s.rows, s.cols, causal);
          REQUIRE(gpu.size() == cpu.size());
          for (int64_t h = 0; h < s.heads; ++h) {
            std::vector<int64_t> indices;
            for (int64_t b = 0; b < s.batch; ++b)
              for (int64_t r = 0; r < s.rows; ++r)
                for (int64_t c = 0; c < (causal ? r + 1 : s.cols); ++c)
                  indices.push_back(((b * s.heads + h) * s.rows + r) * s.cols + c);
            CAPTURE(h);
            require_agrees(gpu[size_t(h)], cpu[size_t(h)], finite_abs_sum(buffer, indices));
          }
          const TensorStats whole_gpu = combine_heads(gpu), whole_cpu = combine_heads(cpu);
          REQUIRE(whole_gpu.first_nonfinite == whole_cpu.first_nonfinite);
          REQUIRE(whole_gpu.first_kind == whole_cpu.first_kind);
        }
      }
    }
  }
}

TEST_CASE("CUDA statistics of many tensors come back in one collect", "[gpu]") {
  std::vector<TestBuffer> buffers;
  for (int i = 0; i < 40; ++i) {
    buffers.push_back(make_buffer(kAllTypes[i % 3], 1000 + 977 * i, 900 + uint32_t(i), {1e-3, true}));
  }
  std::vector<std::unique_ptr<DeviceCopy>> copies;
  for (const TestBuffer& b : buffers) copies.push_back(std::make_unique<DeviceCopy>(b));
  const int64_t batch = 2, heads = 4, rows = 48;
  const TestBuffer scores = make_buffer(ElemType::kF16, batch * heads * rows * rows, 77, {1e-3, true});
  const DeviceCopy scores_copy(scores);

  cuda::DeviceStatsBuffer results(static_cast<int64_t>(buffers.size()) + heads);
  for (size_t i = 0; i < buffers.size(); ++i) {
    REQUIRE(results.add(copies[i]->data(), buffers[i].type, buffers[i].size()) == int64_t(i));
  }
  const int64_t first_head =
      results.add_heads(scores_copy.data(), ElemType::kF16, batch, heads, rows, rows, true);
  REQUIRE(first_head == int64_t(buffers.size()));
  REQUIRE(results.size() == results.capacity());
  REQUIRE_THROWS_AS(results.add(copies[0]->data(), buffers[0].type, 1), std::length_error);

  const std::vector<TensorStats> gpu = results.collect();
  REQUIRE(results.size() == 0);
  REQUIRE(gpu.size() == buffers.size() + heads);
  for (size_t i = 0; i < buffers.size(); ++i) {
    CAPTURE(i);
    require_agrees(gpu[i], compute_stats(buffers[i].data(), buffers[i].type, buffers[i].size()),
                   finite_abs_sum(buffers[i], all_indices(buffers[i].size())));
  }
  const std::vector<TensorStats> cpu_heads =
      compute_head_stats(scores.data(), ElemType::kF16, batch, heads, rows, rows, true);
  for (int64_t h = 0; h < heads; ++h) {
    REQUIRE(gpu[size_t(first_head + h)].nan_count == cpu_heads[size_t(h)].nan_count);
    REQUIRE(gpu[size_t(first_head + h)].first_nonfinite == cpu_heads[size_t(h)].first_nonfinite);
  }
  // The emptied buffer takes the next step's requests from slot 0.
  REQUIRE(results.add(copies[1]->data(), buffers[1].type, buffers[1].size()) == 0);
}

TEST_CASE("CUDA statistics are bitwise reproducible", "[gpu]") {
  for (ElemType type : kAllTypes) {
    CAPTURE(type_name(type));
    const TestBuffer buffer = make_buffer(type, 5'000'011, 3, {1e-5, true});
    const DeviceCopy copy(buffer);
    cuda::DeviceStatsBuffer results(2);
    results.add(copy.data(), type, buffer.size());
    results.add(copy.data(), type, buffer.size());
    const std::vector<TensorStats> twice = results.collect();
    REQUIRE(std::memcmp(&twice[0].sum, &twice[1].sum, sizeof(double)) == 0);
    REQUIRE(std::memcmp(&twice[0].sum_sq, &twice[1].sum_sq, sizeof(double)) == 0);
  }
}

TEST_CASE("CUDA statistics reject impossible requests", "[gpu]") {
  cuda::DeviceStatsBuffer results(4);
  REQUIRE_THROWS_AS(results.add(nullptr, ElemType::kF32, -1), std::invalid_argument);
  REQUIRE_THROWS_AS(results.add_heads(nullptr, ElemType::kF32, 1, 1, 2, 3, true), std::invalid_argument);
  REQUIRE_THROWS_AS(results.add_heads(nullptr, ElemType::kF32, 1, 5, 1, 1, false), std::length_error);
  REQUIRE(results.size() == 0);
  REQUIRE_THROWS_AS(cuda::DeviceStatsBuffer(0), std::invalid_argument);
}

}  // namespace nanreplay
