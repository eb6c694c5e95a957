// Data-layer units: sample profiles (runs, entropy), the robust baseline,
// and the low-entropy rule.
#include <catch2/catch.hpp>

#include <cmath>

#include "probes/data_checks.h"

using namespace nanreplay;

TEST_CASE("profile_tokens finds the longest run and its start", "[data]") {
  const std::vector<int64_t> tokens = {1, 2, 2, 3, 3, 3, 3, 4, 3};
  const SampleProfile p = profile_tokens(tokens.data(), static_cast<int64_t>(tokens.size()));
  CHECK(p.longest_run == 4);
  CHECK(p.run_position == 3);
  CHECK(p.run_token == 3);
}

TEST_CASE("profile_tokens entropy is Shannon's in bits, for small and huge ids", "[data]") {
  const std::vector<int64_t> uniform = {0, 1, 2, 3, 4, 5, 6, 7};
  CHECK(profile_tokens(uniform.data(), 8).entropy_bits == Approx(3.0));
  const std::vector<int64_t> two = {5, 9, 5, 9};
  CHECK(profile_tokens(two.data(), 4).entropy_bits == Approx(1.0));
  const std::vector<int64_t> constant = {7, 7, 7};
  CHECK(profile_tokens(constant.data(), 3).entropy_bits == Approx(0.0).margin(1e-12));
  // Ids beyond the direct table go through the hash table: same answer.
  const std::vector<int64_t> big = {4000000000, 4000000001, 4000000000, 4000000001};
  CHECK(profile_tokens(big.data(), 4).entropy_bits == Approx(1.0));
  const std::vector<int64_t> skew = {1, 1, 1, 2};  // p = 3/4, 1/4
  CHECK(profile_tokens(skew.data(), 4).entropy_bits ==
        Approx(-(0.75 * std::log2(0.75) + 0.25 * std::log2(0.25))));
}

TEST_CASE("entropy baseline: median, MAD and robust z below it", "[data]") {
  const RobustBaseline b = robust_baseline(std::vector<double>{4.0, 4.1, 4.2, 4.3, 4.4});
  CHECK(b.median == Approx(4.2));
  CHECK(b.mad == Approx(0.1));
  CHECK(b.z_below(4.2) == 0.0);
  CHECK(b.z_below(3.2) == Approx(1.0 / (1.4826 * 0.1)));
  CHECK(b.z_below(5.0) == 0.0);  // above the median is never low
}

TEST_CASE("low entropy needs both the z-score and the ratio", "[data]") {
  std::vector<double> typical(100, 5.0);
  for (size_t i = 0; i < typical.size(); ++i) typical[i] += 0.01 * static_cast<double>(i % 7);
  const RobustBaseline base = robust_baseline(typical);
  DataCheckOptions options;
  SampleProfile p;
  p.entropy_bits = 1.0;
  CHECK(is_low_entropy(p, base, options));
  p.entropy_bits = 4.5;  // many z below but above 0.6 x median: a natural sample
  CHECK_FALSE(is_low_entropy(p, base, options));
  CHECK(options.repeat_threshold(32) == 8);
  CHECK(options.repeat_threshold(2048) == 64);
  CHECK(options.repeat_threshold(128) == 32);
}
