// Throughput of the fused statistics kernel against a plain float sum over the
// same 256 MiB buffer, side by side in one run. The sum is the floor any probe
// pays (one read of the memory); the ratio says what the extra statistics cost.
// Usage: bench_stats [MiB] [repeats]. Best-of-N wall time; no LibTorch.
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/tensor_stats.h"

namespace {

using Clock = std::chrono::steady_clock;

template <class Fn>
double best_seconds(int repeats, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    fn();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (seconds < best) best = seconds;
  }
  return best;
}

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

volatile double g_sink;  // keeps results alive

void report(const char* name, double bytes, double seconds, double baseline_gbs) {
  const double gbs = bytes / seconds / 1e9;
  std::printf("  %-48s %8.2f GB/s   x%.2f of plain sum\n", name, gbs, gbs / baseline_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 256;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  const int64_t bytes = mib << 20;
  const int64_t f32_count = bytes / 4, half_count = bytes / 2;

  std::vector<float> f32(static_cast<size_t>(f32_count));
  std::vector<uint16_t> bf16(static_cast<size_t>(half_count)), f16(static_cast<size_t>(half_count));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : f32) x = normal(rng);
  for (int64_t i = 0; i < half_count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f32[static_cast<size_t>(i % f32_count)], 4);
    bf16[static_cast<size_t>(i)] = static_cast<uint16_t>(bits >> 16);
    // A normal-range half: sign, exponent 10..20, random mantissa.
    f16[static_cast<size_t>(i)] =
        static_cast<uint16_t>((bits & 0x8000u) | ((10 + bits % 11) << 10) | ((bits >> 7) & 0x3FF));
  }

  // The same f32 data with one NaN in every 4096 elements (a bad channel):
  // every block then also takes the exact path.
  std::vector<float> f32_nan = f32;
  for (int64_t i = 1000; i < f32_count; i += 4096) f32_nan[static_cast<size_t>(i)] = NAN;

  const int threads = omp_get_max_threads();
  std::printf("buffer %lld MiB (f32 %lld elements, bf16/f16 %lld), best of %d, %d OpenMP threads\n",
              static_cast<long long>(mib), static_cast<long long>(f32_count),
              static_cast<long long>(half_count), repeats, threads);

  const double plain = best_seconds(repeats, [&] { g_sink = plain_sum(f32.data(), f32_count); });
  const double plain_gbs = double(bytes) / plain / 1e9;
  std::printf("  %-48s %8.2f GB/s   (baseline)\n", "plain float sum f32, 1 thread", plain_gbs);

  struct Case {
    const char* name;
    const void* data;
    nanreplay::ElemType type;
    int64_t count;
  };
  const Case cases[] = {
      {"f32", f32.data(), nanreplay::ElemType::kF32, f32_count},
      {"bf16", bf16.data(), nanreplay::ElemType::kBF16, half_count},
      {"f16", f16.data(), nanreplay::ElemType::kF16, half_count},
      {"f32, NaN in every block", f32_nan.data(), nanreplay::ElemType::kF32, f32_count}};
  for (int thread_count : {1, threads}) {
    omp_set_num_threads(thread_count);
    const char* plural = thread_count == 1 ? "" : "s";
    char label[96];
    std::snprintf(label, sizeof label, "simd float sum f32, %d thread%s", thread_count, plural);
    report(label, double(bytes),
           best_seconds(repeats, [&] { g_sink = simd_parallel_sum(f32.data(), f32_count); }),
           plain_gbs);
    for (const Case& c : cases) {
      std::snprintf(label, sizeof label, "compute_stats %s, %d thread%s", c.name, thread_count,
                    plural);
      const double seconds = best_seconds(
          repeats, [&] { g_sink = nanreplay::compute_stats(c.data, c.type, c.count).sum; });
      report(label, double(bytes), seconds, plain_gbs);
    }
    if (threads == 1) break;
  }
  return 0;
}
