// scan_token_stream against profile_sample on crafted windows: the scan skips
// the exact run count where a vectorized filter proves no run reaches the
// threshold, and computes entropy in one counting pass; neither may change
// what it reports. Windows hold runs of exactly the threshold, one token short
// of it, and near misses that pass the filter's spot checks but are broken
// between them; uint16 and uint32 shards; a stream spanning two shards.
#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <vector>

#include "loaders/bundle/token_shards.h"
#include "probes/data_checks.h"
#include "tests/loader_test_support.h"

namespace {

namespace fs = std::filesystem;
using nanreplay::ShardSpec;
using nanreplay::TokenDtype;

constexpr int64_t kSeqLen = 256;
constexpr int64_t kThreshold = 64;  // DataCheckOptions' automatic one for seq_len 256

template <typename Token>
void write_tokens(const fs::path& path, const std::vector<uint32_t>& tokens) {
  std::vector<Token> narrow(tokens.begin(), tokens.end());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(narrow.data()), static_cast<std::streamsize>(narrow.size() * sizeof(Token)));
}

// Random tokens with crafted windows; returns the samples holding a run >= kThreshold.
std::vector<uint32_t> crafted_stream(std::set<int64_t>& expected_runs) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> id(0, 999);
  std::vector<uint32_t> tokens(static_cast<size_t>(40 * kSeqLen + 1));
  for (uint32_t& t : tokens) t = id(rng);
  auto fill = [&](int64_t sample, int64_t offset, int64_t length, uint32_t token) {
    for (int64_t i = 0; i < length; ++i) tokens[static_cast<size_t>(sample * kSeqLen + offset + i)] = token;
  };
  fill(3, 10, kThreshold, 7);           // exactly the threshold
  expected_runs.insert(3);
  fill(5, 100, kThreshold - 1, 8);      // one short
  fill(9, 0, 200, 9);                   // long, at the window's start
  expected_runs.insert(9);
  fill(12, kSeqLen + 1 - kThreshold, kThreshold, 10);  // ends on the window's last token
  expected_runs.insert(12);
  // Near miss: equal at every spot the filter checks (0, 15, 31, 47, 63 from
  // the start), one different token in between.
  fill(15, 20, kThreshold, 11);
  tokens[static_cast<size_t>(15 * kSeqLen + 20 + 40)] = 12;
  // A window of one token (entropy 0) and one of two alternating tokens.
  fill(20, 0, kSeqLen + 1, 13);
  expected_runs.insert(20);
  for (int64_t i = 0; i <= kSeqLen; ++i) tokens[static_cast<size_t>(25 * kSeqLen + i)] = i % 2 ? 14 : 15;
  return tokens;
}

template <typename Token>
void check_scan_against_profiles(TokenDtype dtype, bool two_shards) {
  nanreplay_test::TempDir dir;
  std::set<int64_t> expected_runs;
  const std::vector<uint32_t> tokens = crafted_stream(expected_runs);
  std::vector<ShardSpec> specs;
  const size_t split = two_shards ? tokens.size() / 3 + 5 : tokens.size();  // mid-sample
  fs::create_directories(dir.path() / "data");
  write_tokens<Token>(dir.path() / "data/a.bin", {tokens.begin(), tokens.begin() + static_cast<long>(split)});
  specs.push_back({"data/a.bin", dtype, static_cast<int64_t>(split), std::nullopt});
  if (two_shards) {
    write_tokens<Token>(dir.path() / "data/b.bin", {tokens.begin() + static_cast<long>(split), tokens.end()});
    specs.push_back({"data/b.bin", dtype, static_cast<int64_t>(tokens.size() - split), std::nullopt});
  }
  const nanreplay::TokenStream stream(dir.path(), specs, "manifest.json");
  const nanreplay::DataCheckOptions options;
  REQUIRE(options.repeat_threshold(kSeqLen) == kThreshold);
  const nanreplay::DataScanResult scan = nanreplay::scan_token_stream(stream, kSeqLen, 1000, options, 2, {});

  std::set<int64_t> found;
  for (const nanreplay::SampleProfile& p : scan.repeat_runs) {
    found.insert(p.sample);
    const nanreplay::SampleProfile exact = nanreplay::profile_sample(stream, p.sample, kSeqLen);
    CHECK(p.longest_run == exact.longest_run);
    CHECK(p.run_position == exact.run_position);
    CHECK(p.run_token == exact.run_token);
  }
  CHECK(found == expected_runs);
  // Every sample's entropy, as the baseline sees it, against the exact profile.
  std::vector<double> exact_entropies;
  for (int64_t s = 0; s < stream.num_samples(kSeqLen); ++s) {
    exact_entropies.push_back(nanreplay::profile_sample(stream, s, kSeqLen).entropy_bits);
  }
  const nanreplay::RobustBaseline exact = nanreplay::robust_baseline(exact_entropies);
  // The scan keeps entropies as float: equal to the exact ones to float precision.
  CHECK(scan.baseline.median == Approx(exact.median).epsilon(1e-6));
  CHECK(scan.baseline.mad == Approx(exact.mad).epsilon(1e-4).margin(1e-6));
  std::set<int64_t> low;
  for (const nanreplay::SampleProfile& p : scan.low_entropy) {
    low.insert(p.sample);
    if (p.sample == 20) CHECK(p.entropy_bits == Approx(0.0).margin(1e-12));
    if (p.sample == 25) CHECK(p.entropy_bits == Approx(1.0).epsilon(1e-3));
  }
  CHECK(low.count(20) == 1);  // one token
  CHECK(low.count(25) == 1);  // two alternating tokens
}

}  // namespace

TEST_CASE("scan: the run filter and one-pass entropy report what exact profiles do", "[data][scan]") {
  SECTION("uint16, one shard") { check_scan_against_profiles<uint16_t>(TokenDtype::kUint16, false); }
  SECTION("uint16, two shards") { check_scan_against_profiles<uint16_t>(TokenDtype::kUint16, true); }
  SECTION("uint32, two shards") { check_scan_against_profiles<uint32_t>(TokenDtype::kUint32, true); }
}
