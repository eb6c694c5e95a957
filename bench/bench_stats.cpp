// Throughput of the fused statistics kernel, side by side in one run, against
// (a) a plain sum over the same buffer (f32, bf16, f16: one sequential float
//     accumulator, the loop anyone would write); the target is a
//     ratio of at least 0.8;
// (b) the same sum reordered over SIMD lanes and the same threads: about
//     the memory-bandwidth floor of any one-read pass, reported for scale;
// (c) what a probe written with LibTorch would cost: `abs().max()` plus
//     `isfinite().all()`, two passes and two temporaries; target above 1.
// Every repetition runs every case once, in turn, so drift in a shared
// machine's load hits all of them alike; each figure is the median.
// Usage: bench_stats [MiB] [repetitions] [threads]   (default 256 MiB, 9, all cores)
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"

namespace {

using Clock = std::chrono::steady_clock;

volatile double g_sink;  // keeps results alive

// The baseline as anyone would write it: one sequential float accumulator.
// Without -ffast-math the compiler may not reorder it, so it is latency bound.
__attribute__((noinline)) float plain_sum(const float* data, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += data[i];
  return sum;
}

// The same sum with reordering allowed (SIMD lanes, OpenMP threads): about
// the memory-bandwidth ceiling a one-read kernel can reach on this machine.
__attribute__((noinline)) float simd_parallel_sum(const float* data, int64_t n) {
  float sum = 0.0f;
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
  for (int64_t i = 0; i < n; ++i) sum += data[i];
  return sum;
}

// Plain sums of bf16 and f16 buffers as anyone would write them: the
// library's decoder, one sequential float accumulator.
__attribute__((noinline)) float plain_sum_half(const uint16_t* data, int64_t n, float (*decode)(uint16_t)) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += decode(data[i]);
  return sum;
}

// The reordered floor for bf16 (decoding is a shift) ...
__attribute__((noinline)) float simd_parallel_sum_bf16(const uint16_t* data, int64_t n) {
  float sum = 0.0f;
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = uint32_t{data[i]} << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    sum += value;
  }
  return sum;
}

#if defined(__x86_64__)
// ... and for f16 with the F16C conversion instruction (x86-64 only):
// faster than any bit manipulation the kernel's portable decoder can do.
__attribute__((target("avx2,f16c"), noinline)) float simd_parallel_sum_f16(const uint16_t* data,
                                                                          int64_t n) {
  float total = 0.0f;
#pragma omp parallel reduction(+ : total)
  {
    __m256 lanes = _mm256_setzero_ps();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n / 8; ++i) {
      const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 8 * i));
      lanes = _mm256_add_ps(lanes, _mm256_cvtph_ps(halves));
    }
    float parts[8];
    _mm256_storeu_ps(parts, lanes);
    for (float part : parts) total += part;
  }
  return total;
}
#endif

struct Case {
  std::string name;
  double bytes;
  std::function<void()> run;
  std::vector<double> seconds;

  double median() const {
    std::vector<double> sorted = seconds;
    std::sort(sorted.begin(), sorted.end());
    return sorted[sorted.size() / 2];
  }
  double gbs() const { return bytes / median() / 1e9; }
};

struct Buffers {
  std::vector<float> f32;
  std::vector<uint16_t> bf16, f16;
  std::vector<float> f32_nan;  // one NaN in every 4096 elements (a bad channel)
};

Buffers make_buffers(int64_t bytes) {
  const int64_t f32_count = bytes / 4, half_count = bytes / 2;
  Buffers b;
  b.f32.resize(static_cast<size_t>(f32_count));
  b.bf16.resize(static_cast<size_t>(half_count));
  b.f16.resize(static_cast<size_t>(half_count));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : b.f32) x = normal(rng);
  for (int64_t i = 0; i < half_count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &b.f32[static_cast<size_t>(i % f32_count)], 4);
    b.bf16[static_cast<size_t>(i)] = static_cast<uint16_t>(bits >> 16);
    // A normal-range half: sign, exponent 10..20, random mantissa.
    b.f16[static_cast<size_t>(i)] =
        static_cast<uint16_t>((bits & 0x8000u) | ((10 + bits % 11) << 10) | ((bits >> 7) & 0x3FF));
  }
  b.f32_nan = b.f32;
  for (int64_t i = 1000; i < f32_count; i += 4096) b.f32_nan[static_cast<size_t>(i)] = NAN;
  return b;
}

// The probe one would write with LibTorch: largest magnitude, all finite?
void libtorch_probe(const torch::Tensor& t) {
  const double max_abs = t.abs().max().item<double>();
  const bool finite = t.isfinite().all().item<bool>();
  g_sink = max_abs + (finite ? 1.0 : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 256;
  const int repetitions = argc > 2 ? std::max(1, std::atoi(argv[2])) : 9;
  const int threads = argc > 3 ? std::max(1, std::atoi(argv[3])) : omp_get_max_threads();
  omp_set_num_threads(threads);
  torch::set_num_threads(threads);
  const int64_t bytes = mib << 20;
  const Buffers b = make_buffers(bytes);
  const int64_t f32_count = bytes / 4, half_count = bytes / 2;
  using nanreplay::ElemType;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const torch::Tensor f32_tensor = torch::from_blob(const_cast<float*>(b.f32.data()), {f32_count}, f32);
  const torch::Tensor bf16_tensor = torch::from_blob(const_cast<uint16_t*>(b.bf16.data()), {half_count},
                                                     torch::TensorOptions().dtype(torch::kBFloat16));
  const torch::Tensor f16_tensor = torch::from_blob(const_cast<uint16_t*>(b.f16.data()), {half_count},
                                                    torch::TensorOptions().dtype(torch::kHalf));

  auto stats = [](const void* data, ElemType type, int64_t n) {
    return [=] { g_sink = nanreplay::compute_stats(data, type, n).sum; };
  };
  std::vector<Case> cases = {
      {"plain sum f32", double(bytes), [&] { g_sink = plain_sum(b.f32.data(), f32_count); }, {}},
      {"plain sum bf16", double(bytes),
       [&] { g_sink = plain_sum_half(b.bf16.data(), half_count, nanreplay::bf16_to_float); }, {}},
      {"plain sum f16", double(bytes),
       [&] { g_sink = plain_sum_half(b.f16.data(), half_count, nanreplay::f16_to_float); }, {}},
      {"simd sum f32", double(bytes), [&] { g_sink = simd_parallel_sum(b.f32.data(), f32_count); }, {}},
      {"simd sum bf16", double(bytes), [&] { g_sink = simd_parallel_sum_bf16(b.bf16.data(), half_count); }, {}},
#if defined(__x86_64__)
      {"simd sum f16 (F16C)", double(bytes), [&] { g_sink = simd_parallel_sum_f16(b.f16.data(), half_count); }, {}},
#endif
      {"compute_stats f32", double(bytes), stats(b.f32.data(), ElemType::kF32, f32_count), {}},
      {"compute_stats bf16", double(bytes), stats(b.bf16.data(), ElemType::kBF16, half_count), {}},
      {"compute_stats f16", double(bytes), stats(b.f16.data(), ElemType::kF16, half_count), {}},
      {"compute_stats f32, NaN in every block", double(bytes),
       stats(b.f32_nan.data(), ElemType::kF32, f32_count), {}},
      {"libtorch abs().max() + isfinite().all() f32", double(bytes), [&] { libtorch_probe(f32_tensor); }, {}},
      {"libtorch abs().max() + isfinite().all() bf16", double(bytes), [&] { libtorch_probe(bf16_tensor); }, {}},
      {"libtorch abs().max() + isfinite().all() f16", double(bytes), [&] { libtorch_probe(f16_tensor); }, {}},
  };
  for (Case& c : cases) c.run();  // warm up: page in, start thread pools
  for (int r = 0; r < repetitions; ++r) {
    for (Case& c : cases) {
      const auto start = Clock::now();
      c.run();
      c.seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }

  std::printf("buffer %lld MiB, %d threads (OpenMP and LibTorch), median of %d interleaved repetitions\n",
              static_cast<long long>(mib), threads, repetitions);
  for (const Case& c : cases) std::printf("  %-46s %8.2f GB/s\n", c.name.c_str(), c.gbs());
  auto find = [&](const std::string& name) -> const Case& {
    return *std::find_if(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; });
  };
  auto ratio = [&](const std::string& numerator, const std::string& denominator) {
    const auto has = [&](const std::string& name) {
      return std::any_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; });
    };
    return has(numerator) && has(denominator) ? find(numerator).gbs() / find(denominator).gbs()
                                              : std::nan("");
  };
  std::printf("ratios of throughput, compute_stats over:\n");
  std::printf("  %-5s %-28s %-30s %s\n", "", "plain sum (target >= 0.8)", "simd sum, same threads",
              "libtorch abs().max()+isfinite().all() (target > 1)");
  for (const std::string type : {"f32", "bf16", "f16"}) {
    const std::string simd = type == "f16" ? "simd sum f16 (F16C)" : "simd sum " + type;
    std::printf("  %-5s %-28.2f %-30.2f %.1f\n", type.c_str(), ratio("compute_stats " + type, "plain sum " + type),
                ratio("compute_stats " + type, simd),
                ratio("compute_stats " + type, "libtorch abs().max() + isfinite().all() " + type));
  }
  std::printf("  f32 with a NaN in every 4096 elements, over plain sum f32: %.2f\n",
              ratio("compute_stats f32, NaN in every block", "plain sum f32"));
  return 0;
}
