// Tests for loaders/bundle/sampler.cpp against references PyTorch wrote:
// tests/fixtures/randperm.json (made by make_randperm_fixture.py with torch
// 1.13) holds torch.randperm outputs and DistributedSampler(drop_last) rank
// lists; plus explicit sample lists and steps outside the epoch.
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <cstdint>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/sampler.h"
#include "loaders/bundle/token_shards.h"

namespace {

using nanreplay::InputError;
using nanreplay::Manifest;
using nanreplay::SamplerSpec;
using nanreplay::StepEntry;
using nlohmann::json;
using Lists = std::vector<std::vector<int64_t>>;

using nanreplay_test::kManifestLabel;
using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;

json load_fixture() {
  const std::string path = std::string(NANREPLAY_SOURCE_DIR) + "/tests/fixtures/randperm.json";
  std::ifstream in(path);
  REQUIRE(in.good());
  return json::parse(in);
}

std::vector<int64_t> as_ints(const json& list) { return list.get<std::vector<int64_t>>(); }

std::string sha256_of_int64s(const std::vector<int64_t>& values) {
  return nanreplay::sha256_hex(reinterpret_cast<const uint8_t*>(values.data()),
                               values.size() * sizeof(int64_t));
}

StepEntry entry(int64_t step, size_t manifest_index, std::optional<Lists> samples = std::nullopt) {
  StepEntry e;
  e.step = step;
  e.dir = "steps/" + std::to_string(step);
  e.manifest_index = manifest_index;
  e.samples = std::move(samples);
  return e;
}

// A manifest with only what the sampler reads filled in.
Manifest sampler_manifest(int64_t world_size, int64_t micro_batch, int64_t grad_accum,
                          uint64_t seed, int64_t epoch, int64_t epoch_start_step) {
  Manifest m;
  m.data.world_size = world_size;
  m.data.micro_batch_size = micro_batch;
  m.data.grad_accum_steps = grad_accum;
  m.data.sampler.kind = SamplerSpec::Kind::kRandperm;
  m.data.sampler.seed = seed;
  m.data.sampler.epoch = epoch;
  m.data.sampler.epoch_start_step = epoch_start_step;
  m.steps = {entry(epoch_start_step, 0)};
  return m;
}

}  // namespace

TEST_CASE("sampler: torch_randperm equals torch.randperm bit for bit", "[loaders][sampler]") {
  const json fixture = load_fixture();
  REQUIRE(fixture.at("randperm").size() >= 20);
  for (const json& c : fixture.at("randperm")) {
    const int64_t n = c.at("n").get<int64_t>();
    const uint64_t seed = c.at("seed").get<uint64_t>();
    CAPTURE(n, seed);
    const std::vector<int64_t> perm = nanreplay::torch_randperm(n, seed);
    REQUIRE(static_cast<int64_t>(perm.size()) == n);
    if (c.contains("perm")) {
      CHECK(perm == as_ints(c.at("perm")));
      continue;
    }
    const std::vector<int64_t> head = as_ints(c.at("head"));
    const std::vector<int64_t> tail = as_ints(c.at("tail"));
    CHECK(std::vector<int64_t>(perm.begin(), perm.begin() + head.size()) == head);
    CHECK(std::vector<int64_t>(perm.end() - tail.size(), perm.end()) == tail);
    CHECK(sha256_of_int64s(perm) == c.at("sha256_int64_le").get<std::string>());
  }
  CHECK_THROWS_AS(nanreplay::torch_randperm(-1, 0), std::invalid_argument);
}

TEST_CASE("sampler: randperm steps slice DistributedSampler's rank lists", "[loaders][sampler]") {
  const json fixture = load_fixture();
  REQUIRE_FALSE(fixture.at("distributed").empty());
  for (const json& c : fixture.at("distributed")) {
    const int64_t num_samples = c.at("num_samples").get<int64_t>();
    const int64_t world = c.at("world_size").get<int64_t>();
    CAPTURE(num_samples, world);
    // B = 2 * 3 = 6 rarely divides a rank's list: the tail is never read.
    const int64_t epoch_start = 100;
    const Manifest m = sampler_manifest(world, 2, 3, c.at("seed").get<uint64_t>(),
                                        c.at("epoch").get<int64_t>(), epoch_start);
    const nanreplay::StepSampler sampler(m, num_samples, kManifestLabel);
    const int64_t per_rank = num_samples / world;
    const int64_t steps_in_epoch = per_rank / 6;
    REQUIRE(steps_in_epoch >= 1);

    Lists concatenated(static_cast<size_t>(world));
    for (int64_t s = 0; s < steps_in_epoch; ++s) {
      const Lists step_lists = sampler.randperm_samples(epoch_start + s);
      REQUIRE(static_cast<int64_t>(step_lists.size()) == world);
      for (int64_t r = 0; r < world; ++r) {
        REQUIRE(step_lists[r].size() == 6);
        concatenated[r].insert(concatenated[r].end(), step_lists[r].begin(), step_lists[r].end());
      }
    }
    for (int64_t r = 0; r < world; ++r) {
      const std::vector<int64_t> torch_list = as_ints(c.at("ranks")[r]);
      REQUIRE(static_cast<int64_t>(torch_list.size()) == per_rank);
      CHECK(concatenated[r] ==
            std::vector<int64_t>(torch_list.begin(), torch_list.begin() + steps_in_epoch * 6));
    }
    REQUIRE_INPUT_ERROR(sampler.randperm_samples(epoch_start + steps_in_epoch), kManifestLabel,
                        "steps", "got " + std::to_string(epoch_start + steps_in_epoch));
    REQUIRE_INPUT_ERROR(sampler.randperm_samples(epoch_start - 1), kManifestLabel, "steps",
                        "epoch_start_step 100");
  }
}

TEST_CASE("sampler: samples_for follows the manifest's seed and epoch", "[loaders][sampler]") {
  Manifest m = sampler_manifest(2, 1, 2, 1234, 3, 10);
  m.steps = {entry(10, 0), entry(12, 1)};
  const nanreplay::StepSampler sampler(m, 20, kManifestLabel);
  // Seed + epoch = 1237; each rank's list is perm[r::2], B = 2.
  const std::vector<int64_t> perm = nanreplay::torch_randperm(20, 1237);
  CHECK(sampler.samples_for(m.steps[0]) == Lists{{perm[0], perm[2]}, {perm[1], perm[3]}});
  CHECK(sampler.samples_for(m.steps[1]) == Lists{{perm[8], perm[10]}, {perm[9], perm[11]}});
  CHECK(sampler.randperm_samples(12) == sampler.samples_for(m.steps[1]));
  // Each rank holds 10 samples: 5 steps of 2, so steps 10..14.
  CHECK_NOTHROW(sampler.samples_for(entry(14, 5)));
  REQUIRE_INPUT_ERROR(sampler.samples_for(entry(15, 5)), kManifestLabel, "steps[5].step",
                      "expected a step in [10, 15)", "got 15");
  REQUIRE_INPUT_ERROR(sampler.samples_for(entry(9, 3)), kManifestLabel, "steps[3].step",
                      "expected a step in [10, 15)", "got 9");
  // A step the manifest lists is named by its manifest position.
  m.steps = {entry(10, 0), entry(40, 1)};
  const nanreplay::StepSampler with_late_step(m, 20, kManifestLabel);
  REQUIRE_INPUT_ERROR(with_late_step.randperm_samples(40), kManifestLabel, "steps[1].step");
}

TEST_CASE("sampler: too few samples for one step leaves every step outside the epoch",
          "[loaders][sampler]") {
  const Manifest m = sampler_manifest(4, 2, 1, 0, 0, 0);
  const nanreplay::StepSampler sampler(m, 7, kManifestLabel);  // 1 sample per rank, B = 2
  REQUIRE_INPUT_ERROR(sampler.samples_for(m.steps[0]), kManifestLabel, "steps[0].step",
                      "[0, 0)");
  const nanreplay::StepSampler empty(m, 0, kManifestLabel);
  REQUIRE_INPUT_ERROR(empty.samples_for(m.steps[0]), kManifestLabel, "steps[0].step");
}

TEST_CASE("sampler: explicit samples win and are validated", "[loaders][sampler]") {
  Manifest m = sampler_manifest(2, 2, 1, 5, 0, 0);
  const Lists recorded = {{3, 4}, {0, 9}};
  const nanreplay::StepSampler sampler(m, 10, kManifestLabel);

  SECTION("they win over randperm when present") {
    CHECK(sampler.samples_for(entry(0, 0, recorded)) == recorded);
    CHECK(sampler.explicit_samples(entry(0, 0, recorded)) == recorded);
    CHECK_FALSE(sampler.explicit_samples(entry(0, 0)).has_value());
    CHECK(sampler.samples_for(entry(0, 0)) == sampler.randperm_samples(0));
  }
  SECTION("one list per rank") {
    REQUIRE_INPUT_ERROR(sampler.samples_for(entry(0, 2, Lists{{3, 4}})), kManifestLabel,
                        "steps[2].samples", "data.world_size = 2", "got 1");
  }
  SECTION("B indices per rank") {
    REQUIRE_INPUT_ERROR(sampler.samples_for(entry(0, 2, Lists{{3, 4}, {0, 9, 1}})), kManifestLabel,
                        "steps[2].samples[1]", "expected 2 sample indices", "got 3");
  }
  SECTION("indices within the stream") {
    REQUIRE_INPUT_ERROR(sampler.samples_for(entry(0, 2, Lists{{3, 4}, {0, 10}})), kManifestLabel,
                        "steps[2].samples[1][1]", "[0, 10)", "got 10");
    REQUIRE_INPUT_ERROR(sampler.explicit_samples(entry(0, 2, Lists{{-1, 4}, {0, 1}})), kManifestLabel,
                        "steps[2].samples[0][0]", "got -1");
  }
}

TEST_CASE("sampler: the explicit sampler reads only the recorded lists", "[loaders][sampler]") {
  Manifest m = sampler_manifest(1, 1, 2, 0, 0, 0);
  m.data.sampler.kind = SamplerSpec::Kind::kExplicit;
  const nanreplay::StepSampler sampler(m, 4, kManifestLabel);
  CHECK(sampler.samples_for(entry(999, 0, Lists{{3, 3}})) == Lists{{3, 3}});
  REQUIRE_INPUT_ERROR(sampler.samples_for(entry(999, 4)), kManifestLabel, "steps[4].samples",
                      "explicit");
  CHECK_THROWS_AS(sampler.randperm_samples(0), std::logic_error);
}

TEST_CASE("sampler: works from a parsed manifest", "[loaders][sampler]") {
  const Manifest m = nanreplay::parse_manifest(R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "arch": "gpt2", "vocab_size": 32, "hidden_size": 8, "num_layers": 1,
               "num_heads": 2, "max_seq_len": 4 },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint16", "tokens": 41 } ],
              "seq_len": 4, "micro_batch_size": 2, "grad_accum_steps": 2, "world_size": 2,
              "sampler": { "kind": "randperm", "seed": 7, "epoch": 1, "epoch_start_step": 3 } },
    "steps": [ { "step": 4, "dir": "steps/4", "samples": [[0, 1, 2, 3], [4, 5, 6, 7]] },
               { "step": 3, "dir": "steps/3" },
               { "step": 2, "dir": "steps/2" } ]
  })", kManifestLabel);
  // 41 tokens, seq_len 4: 10 samples, 5 per rank, B = 4: only step 3 is in the epoch.
  const nanreplay::StepSampler sampler(m, 10, kManifestLabel);
  REQUIRE(m.steps[0].step == 2);
  REQUIRE_INPUT_ERROR(sampler.samples_for(m.steps[0]), kManifestLabel, "steps[2].step");
  const std::vector<int64_t> perm = nanreplay::torch_randperm(10, 8);
  CHECK(sampler.samples_for(m.steps[1]) ==
        Lists{{perm[0], perm[2], perm[4], perm[6]}, {perm[1], perm[3], perm[5], perm[7]}});
  CHECK(sampler.samples_for(m.steps[2]) == Lists{{0, 1, 2, 3}, {4, 5, 6, 7}});
}
