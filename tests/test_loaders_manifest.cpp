// Tests for loaders/bundle/manifest.cpp and loaders/base/json_util.cpp: the spec's example
// manifest, defaults, and one bad input per rule, each asserting that the
// InputError names the file and the full key path (or byte) at fault.
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/base/json_util.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/manifest_writer.h"

namespace {

using nanreplay::InputError;
using nlohmann::json;

using nanreplay_test::kManifestLabel;
using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;
const std::string kSha(64, 'a');

// The example manifest of the bundle format (docs/bundle-format.md) with a valid checksum.
json example_manifest() {
  json manifest = R"({
    "format": "nanreplay.bundle",
    "version": 1,
    "model": {
      "arch": "llama",
      "vocab_size": 512, "hidden_size": 128, "num_layers": 4,
      "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 344,
      "max_seq_len": 128, "norm_eps": 1e-5, "rope_theta": 10000.0,
      "tie_embeddings": false
    },
    "precision": { "compute": "fp32" },
    "optimizer": { "kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8,
                   "weight_decay": 0.1, "grad_clip": 1.0 },
    "data": {
      "shards": [ { "path": "data/shard_000.bin", "dtype": "uint16",
                    "tokens": 65536, "sha256": "" } ],
      "seq_len": 64,
      "micro_batch_size": 4, "grad_accum_steps": 2, "world_size": 1,
      "sampler": { "kind": "randperm", "seed": 1234, "epoch": 0,
                   "epoch_start_step": 0 }
    },
    "steps": [ { "step": 100, "dir": "steps/100" } ],
    "incident": { "step": 105, "symptom": "loss=nan" }
  })"_json;
  manifest["data"]["shards"][0]["sha256"] = kSha;
  return manifest;
}

// The smallest manifest the spec allows: only required keys.
json minimal_manifest() {
  return R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "arch": "llama", "vocab_size": 32, "hidden_size": 16, "num_layers": 1,
               "num_heads": 2, "intermediate_size": 40, "max_seq_len": 8 },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint32", "tokens": 100 } ],
              "seq_len": 8, "micro_batch_size": 2,
              "sampler": { "kind": "randperm", "seed": 0 } },
    "steps": [ { "step": 0, "dir": "steps/0" } ]
  })"_json;
}

nanreplay::Manifest manifest_of(const json& manifest) {
  return nanreplay::parse_manifest(manifest.dump(), kManifestLabel);
}

// Returns `manifest` with the value at JSON pointer `pointer` replaced.
json manifest_with(json manifest, const std::string& pointer, json value) {
  manifest[json::json_pointer(pointer)] = std::move(value);
  return manifest;
}

json without(json manifest, const std::string& pointer) {
  const json::json_pointer where(pointer);
  manifest[where.parent_pointer()].erase(where.back());
  return manifest;
}

}  // namespace

TEST_CASE("manifest: the spec's example parses with every value", "[loaders][manifest]") {
  const nanreplay::Manifest m = manifest_of(example_manifest());
  CHECK(m.version == 1);
  CHECK(m.model.arch == nanreplay::Arch::kLlama);
  CHECK(m.model.vocab_size == 512);
  CHECK(m.model.hidden_size == 128);
  CHECK(m.model.num_layers == 4);
  CHECK(m.model.num_heads == 4);
  CHECK(m.model.num_kv_heads == 4);
  CHECK(m.model.intermediate_size == 344);
  CHECK(m.model.max_seq_len == 128);
  CHECK(m.model.norm_eps == 1e-5);
  CHECK(m.model.rope_theta == 10000.0);
  CHECK_FALSE(m.model.tie_embeddings);
  CHECK(m.model.head_dim() == 32);
  CHECK(m.precision.compute == nanreplay::Compute::kFp32);
  CHECK_FALSE(m.precision.fp8.has_value());
  REQUIRE(m.optimizer.has_value());
  CHECK(m.optimizer->beta1 == 0.9);
  CHECK(m.optimizer->beta2 == 0.95);
  CHECK(m.optimizer->eps == 1e-8);
  CHECK(m.optimizer->weight_decay == 0.1);
  CHECK(m.optimizer->grad_clip == 1.0);
  CHECK(m.optimizer->no_decay.empty());
  REQUIRE(m.data.shards.size() == 1);
  CHECK(m.data.shards[0].path == "data/shard_000.bin");
  CHECK(m.data.shards[0].dtype == nanreplay::TokenDtype::kUint16);
  CHECK(m.data.shards[0].tokens == 65536);
  CHECK(m.data.shards[0].sha256 == kSha);
  CHECK(m.data.seq_len == 64);
  CHECK(m.data.micro_batch_size == 4);
  CHECK(m.data.grad_accum_steps == 2);
  CHECK(m.data.world_size == 1);
  CHECK(m.data.samples_per_rank_step() == 8);
  CHECK(m.data.sampler.kind == nanreplay::SamplerSpec::Kind::kRandperm);
  CHECK(m.data.sampler.seed == 1234);
  CHECK(m.data.sampler.epoch == 0);
  CHECK(m.data.sampler.epoch_start_step == 0);
  REQUIRE(m.steps.size() == 1);
  CHECK(m.steps[0].step == 100);
  CHECK(m.steps[0].dir == "steps/100");
  CHECK_FALSE(m.steps[0].samples.has_value());
  REQUIRE(m.incident.has_value());
  CHECK(m.incident->step == 105);
  CHECK(m.incident->symptom == "loss=nan");
}

TEST_CASE("manifest: absent optional keys take the spec's defaults", "[loaders][manifest]") {
  const nanreplay::Manifest m = manifest_of(minimal_manifest());
  CHECK(m.model.num_kv_heads == 2);
  CHECK(m.model.norm_eps == 1e-5);
  CHECK(m.model.rope_theta == 10000.0);
  CHECK_FALSE(m.model.tie_embeddings);
  CHECK(m.precision.compute == nanreplay::Compute::kFp32);
  CHECK_FALSE(m.optimizer.has_value());
  CHECK_FALSE(m.data.shards[0].sha256.has_value());
  CHECK(m.data.shards[0].dtype == nanreplay::TokenDtype::kUint32);
  CHECK(m.data.grad_accum_steps == 1);
  CHECK(m.data.world_size == 1);
  CHECK(m.data.sampler.epoch == 0);
  CHECK(m.data.sampler.epoch_start_step == 0);
  CHECK_FALSE(m.incident.has_value());
}

TEST_CASE("manifest: an empty optimizer object takes PyTorch's AdamW defaults",
          "[loaders][manifest]") {
  const nanreplay::Manifest m = manifest_of(manifest_with(minimal_manifest(), "/optimizer", json::object()));
  REQUIRE(m.optimizer.has_value());
  CHECK(m.optimizer->beta1 == 0.9);
  CHECK(m.optimizer->beta2 == 0.999);
  CHECK(m.optimizer->eps == 1e-8);
  CHECK(m.optimizer->weight_decay == 0.01);
  CHECK_FALSE(m.optimizer->grad_clip.has_value());

  const nanreplay::Manifest with_globs = manifest_of(manifest_with(
      minimal_manifest(), "/optimizer", {{"no_decay", {"*.bias", "*norm*"}}, {"grad_clip", nullptr}}));
  CHECK(with_globs.optimizer->no_decay == std::vector<std::string>{"*.bias", "*norm*"});
  CHECK_FALSE(with_globs.optimizer->grad_clip.has_value());  // null counts as absent
}

TEST_CASE("manifest: gpt2 fixes the MLP width and ties the head", "[loaders][manifest]") {
  json gpt2 = without(minimal_manifest(), "/model/intermediate_size");
  gpt2["model"]["arch"] = "gpt2";
  gpt2["model"]["num_heads"] = 3;  // odd head_dim is fine without rotary embeddings
  gpt2["model"]["hidden_size"] = 15;
  const nanreplay::Manifest m = manifest_of(gpt2);
  CHECK(m.model.arch == nanreplay::Arch::kGpt2);
  CHECK(m.model.intermediate_size == 60);
  CHECK(m.model.tie_embeddings);
  CHECK(manifest_of(manifest_with(gpt2, "/model/intermediate_size", 60)).model.intermediate_size == 60);
  CHECK(manifest_of(manifest_with(gpt2, "/model/tie_embeddings", true)).model.tie_embeddings);
}

TEST_CASE("manifest: fp8 precision takes the spec's defaults", "[loaders][manifest]") {
  const nanreplay::Manifest m =
      manifest_of(manifest_with(minimal_manifest(), "/precision", {{"compute", "fp8"}}));
  CHECK(m.precision.compute == nanreplay::Compute::kFp8);
  REQUIRE(m.precision.fp8.has_value());
  CHECK(m.precision.fp8->fwd == "e4m3");
  CHECK(m.precision.fp8->bwd == "e5m2");
  CHECK(m.precision.fp8->amax_history_len == 16);
  CHECK(m.precision.fp8->margin == 0.0);

  const nanreplay::Manifest custom = manifest_of(manifest_with(
      minimal_manifest(), "/precision",
      {{"compute", "fp8"},
       {"fp8", {{"fwd", "e5m2"}, {"bwd", "e4m3"}, {"amax_history_len", 4}, {"margin", 1}}}}));
  CHECK(custom.precision.fp8->fwd == "e5m2");
  CHECK(custom.precision.fp8->bwd == "e4m3");
  CHECK(custom.precision.fp8->amax_history_len == 4);
  CHECK(custom.precision.fp8->margin == 1.0);

  for (const char* name : {"bf16", "fp16"}) {
    const nanreplay::Manifest other =
        manifest_of(manifest_with(minimal_manifest(), "/precision", {{"compute", name}}));
    CHECK(std::string(nanreplay::compute_name(other.precision.compute)) == name);
    CHECK_FALSE(other.precision.fp8.has_value());
  }
}

TEST_CASE("manifest: steps are sorted and remember their position", "[loaders][manifest]") {
  json manifest = minimal_manifest();
  manifest["steps"] = R"([{"step": 7, "dir": "steps/7"}, {"step": 3, "dir": "steps/3"},
                          {"step": 5, "dir": "./steps/5", "samples": [[0, 1]]}])"_json;
  const nanreplay::Manifest m = manifest_of(manifest);
  REQUIRE(m.steps.size() == 3);
  CHECK(m.steps[0].step == 3);
  CHECK(m.steps[0].manifest_index == 1);
  CHECK(m.steps[1].step == 5);
  CHECK(m.steps[1].manifest_index == 2);
  REQUIRE(m.steps[1].samples.has_value());
  CHECK(*m.steps[1].samples == std::vector<std::vector<int64_t>>{{0, 1}});
  CHECK(m.steps[2].step == 7);
  CHECK(m.steps[2].manifest_index == 0);
}

TEST_CASE("manifest: values the spec allows at the edges", "[loaders][manifest]") {
  SECTION("upper-case sha256 is normalised to lower case") {
    const nanreplay::Manifest m =
        manifest_of(manifest_with(minimal_manifest(), "/data/shards/0/sha256", std::string(64, 'F')));
    CHECK(m.data.shards[0].sha256 == std::string(64, 'f'));
  }
  SECTION("norm_eps 0 is legal") {
    CHECK(manifest_of(manifest_with(minimal_manifest(), "/model/norm_eps", 0)).model.norm_eps == 0.0);
  }
  SECTION("a seed beyond int64 is kept as uint64") {
    const uint64_t big = std::numeric_limits<uint64_t>::max();
    CHECK(manifest_of(manifest_with(minimal_manifest(), "/data/sampler/seed", big)).data.sampler.seed == big);
  }
  SECTION("seq_len equal to max_seq_len") {
    CHECK(manifest_of(manifest_with(minimal_manifest(), "/data/seq_len", 8)).data.seq_len == 8);
  }
  SECTION("unknown keys are ignored") {
    json manifest = minimal_manifest();
    manifest["future"] = {{"x", 1}};
    manifest["model"]["future"] = "y";
    manifest["data"]["sampler"]["future"] = json::array();
    CHECK_NOTHROW(manifest_of(manifest));
  }
  SECTION("the explicit sampler needs no seed") {
    json manifest = manifest_with(minimal_manifest(), "/data/sampler", {{"kind", "explicit"}});
    manifest["steps"][0]["samples"] = {{0, 1}};
    const nanreplay::Manifest m = manifest_of(manifest);
    CHECK(m.data.sampler.kind == nanreplay::SamplerSpec::Kind::kExplicit);
  }
  SECTION("grouped-query attention") {
    json manifest = manifest_with(minimal_manifest(), "/model/num_heads", 4);
    manifest["model"]["hidden_size"] = 32;
    manifest["model"]["num_kv_heads"] = 2;
    CHECK(manifest_of(manifest).model.num_kv_heads == 2);
  }
}

TEST_CASE("manifest: the format header is checked with a hint", "[loaders][manifest]") {
  REQUIRE_INPUT_ERROR(manifest_of(without(minimal_manifest(), "/format")), kManifestLabel, "format",
                      "\"format\": \"nanreplay.bundle\"");
  REQUIRE_INPUT_ERROR(manifest_of(manifest_with(minimal_manifest(), "/format", "safetensors")), kManifestLabel,
                      "format", "got \"safetensors\"");
  REQUIRE_INPUT_ERROR(manifest_of(manifest_with(minimal_manifest(), "/version", 2)), kManifestLabel,
                      "version: expected 1, got 2", "re-export");
  REQUIRE_INPUT_ERROR(manifest_of(manifest_with(minimal_manifest(), "/version", "1")), kManifestLabel, "version");
  REQUIRE_INPUT_ERROR(manifest_of(without(minimal_manifest(), "/version")), kManifestLabel, "version");
}

TEST_CASE("manifest: the error message has the documented shape", "[loaders][manifest]") {
  REQUIRE_THROWS_WITH(manifest_of(manifest_with(minimal_manifest(), "/model/num_heads", -4)),
                      "bundle/manifest.json: model.num_heads: expected a positive integer, got -4");
}

namespace {

struct BadCase {
  const char* pointer;  // JSON pointer of the value to change
  json value;           // replacement; a discarded value means "remove the key"
  const char* key;      // the key path the error must name
};

const json kRemove = json(json::value_t::discarded);

void check_bad_cases(const json& base, const std::vector<BadCase>& cases) {
  for (const BadCase& bad : cases) {
    CAPTURE(bad.pointer, bad.value.is_discarded() ? "<removed>" : bad.value.dump());
    const json manifest =
        bad.value.is_discarded() ? without(base, bad.pointer) : manifest_with(base, bad.pointer, bad.value);
    REQUIRE_INPUT_ERROR(manifest_of(manifest), kManifestLabel, bad.key);
  }
}

}  // namespace

TEST_CASE("manifest: bad model keys name the key", "[loaders][manifest]") {
  check_bad_cases(minimal_manifest(), {
      {"/model", kRemove, "model"},
      {"/model", json::array(), "model"},
      {"/model/arch", "mistral", "model.arch"},
      {"/model/arch", kRemove, "model.arch"},
      {"/model/vocab_size", kRemove, "model.vocab_size"},
      {"/model/vocab_size", 0, "model.vocab_size"},
      {"/model/hidden_size", -16, "model.hidden_size"},
      {"/model/hidden_size", 16.5, "model.hidden_size"},
      {"/model/hidden_size", 16.0, "model.hidden_size"},
      {"/model/hidden_size", true, "model.hidden_size"},
      {"/model/hidden_size", "16", "model.hidden_size"},
      {"/model/hidden_size", nullptr, "model.hidden_size"},
      {"/model/hidden_size", 18, "model.hidden_size"},  // head_dim 9 is odd for rotary
      {"/model/hidden_size", 17, "model.hidden_size"},  // not a multiple of num_heads
      {"/model/hidden_size", json(std::numeric_limits<uint64_t>::max()), "model.hidden_size"},
      {"/model/num_layers", kRemove, "model.num_layers"},
      {"/model/num_heads", kRemove, "model.num_heads"},
      {"/model/num_heads", 0, "model.num_heads"},
      {"/model/num_kv_heads", 3, "model.num_kv_heads"},
      {"/model/num_kv_heads", 0, "model.num_kv_heads"},
      {"/model/intermediate_size", kRemove, "model.intermediate_size"},
      {"/model/intermediate_size", -1, "model.intermediate_size"},
      {"/model/max_seq_len", kRemove, "model.max_seq_len"},
      {"/model/norm_eps", -1e-5, "model.norm_eps"},
      {"/model/norm_eps", "nan", "model.norm_eps"},
      {"/model/norm_eps", "1e-5", "model.norm_eps"},
      {"/model/rope_theta", 0, "model.rope_theta"},
      {"/model/rope_theta", "inf", "model.rope_theta"},
      {"/model/tie_embeddings", "yes", "model.tie_embeddings"},
  });
}

TEST_CASE("manifest: gpt2 contradictions name the key", "[loaders][manifest]") {
  json gpt2 = without(minimal_manifest(), "/model/intermediate_size");
  gpt2["model"]["arch"] = "gpt2";
  check_bad_cases(gpt2, {
      {"/model/intermediate_size", 40, "model.intermediate_size"},
      {"/model/tie_embeddings", false, "model.tie_embeddings"},
      {"/model/num_kv_heads", 1, "model.num_kv_heads"},
      {"/model/hidden_size", json(std::numeric_limits<int64_t>::max() - 1), "model.hidden_size"},
  });
}

TEST_CASE("manifest: bad precision and optimizer keys name the key", "[loaders][manifest]") {
  json fp8 = manifest_with(minimal_manifest(), "/precision", {{"compute", "fp8"}, {"fp8", json::object()}});
  check_bad_cases(fp8, {
      {"/precision", "fp32", "precision"},
      {"/precision/compute", "int8", "precision.compute"},
      {"/precision/fp8", 3, "precision.fp8"},
      {"/precision/fp8/fwd", "e3m4", "precision.fp8.fwd"},
      {"/precision/fp8/bwd", 5, "precision.fp8.bwd"},
      {"/precision/fp8/amax_history_len", 0, "precision.fp8.amax_history_len"},
      {"/precision/fp8/margin", -1, "precision.fp8.margin"},
  });
  json adamw = manifest_with(minimal_manifest(), "/optimizer", {{"kind", "adamw"}});
  check_bad_cases(adamw, {
      {"/optimizer", true, "optimizer"},
      {"/optimizer/kind", "sgd", "optimizer.kind"},
      {"/optimizer/betas", {0.9}, "optimizer.betas"},
      {"/optimizer/betas", {0.9, 0.95, 0.99}, "optimizer.betas"},
      {"/optimizer/betas", 0.9, "optimizer.betas"},
      {"/optimizer/betas", {0.9, 1.0}, "optimizer.betas[1]"},
      {"/optimizer/betas", {-0.1, 0.9}, "optimizer.betas[0]"},
      {"/optimizer/betas", {"x", 0.9}, "optimizer.betas[0]"},
      {"/optimizer/eps", 0, "optimizer.eps"},
      {"/optimizer/eps", "nan", "optimizer.eps"},
      {"/optimizer/weight_decay", -0.1, "optimizer.weight_decay"},
      {"/optimizer/grad_clip", 0, "optimizer.grad_clip"},
      {"/optimizer/grad_clip", -1, "optimizer.grad_clip"},
      {"/optimizer/no_decay", "*.bias", "optimizer.no_decay"},
      {"/optimizer/no_decay", {"*.bias", 1}, "optimizer.no_decay[1]"},
  });
}

TEST_CASE("manifest: bad data keys name the key", "[loaders][manifest]") {
  check_bad_cases(minimal_manifest(), {
      {"/data", kRemove, "data"},
      {"/data/shards", kRemove, "data.shards"},
      {"/data/shards", json::array(), "data.shards"},
      {"/data/shards", json::object(), "data.shards"},
      {"/data/shards/0", "data/a.bin", "data.shards[0]"},
      {"/data/shards/0/path", kRemove, "data.shards[0].path"},
      {"/data/shards/0/path", "", "data.shards[0].path"},
      {"/data/shards/0/path", "/etc/passwd", "data.shards[0].path"},
      {"/data/shards/0/path", "../outside.bin", "data.shards[0].path"},
      {"/data/shards/0/path", "data/../../x.bin", "data.shards[0].path"},
      {"/data/shards/0/dtype", "int32", "data.shards[0].dtype"},
      {"/data/shards/0/tokens", 0, "data.shards[0].tokens"},
      {"/data/shards/0/tokens", 1.5, "data.shards[0].tokens"},
      {"/data/shards/0/sha256", "abc", "data.shards[0].sha256"},
      {"/data/shards/0/sha256", std::string(63, 'a') + "g", "data.shards[0].sha256"},
      {"/data/seq_len", kRemove, "data.seq_len"},
      {"/data/seq_len", 0, "data.seq_len"},
      {"/data/seq_len", 9, "data.seq_len"},  // above model.max_seq_len
      {"/data/micro_batch_size", kRemove, "data.micro_batch_size"},
      {"/data/micro_batch_size", 0, "data.micro_batch_size"},
      {"/data/grad_accum_steps", 0, "data.grad_accum_steps"},
      {"/data/grad_accum_steps", json(std::numeric_limits<int64_t>::max()), "data.grad_accum_steps"},
      {"/data/world_size", -1, "data.world_size"},
      {"/data/sampler", kRemove, "data.sampler"},
      {"/data/sampler/kind", "random", "data.sampler.kind"},
      {"/data/sampler/kind", kRemove, "data.sampler.kind"},
      {"/data/sampler/seed", kRemove, "data.sampler.seed"},
      {"/data/sampler/seed", -1, "data.sampler.seed"},
      {"/data/sampler/seed", 1.5, "data.sampler.seed"},
      {"/data/sampler/epoch", -1, "data.sampler.epoch"},
      {"/data/sampler/epoch_start_step", -1, "data.sampler.epoch_start_step"},
  });

  json two_shards = minimal_manifest();
  two_shards["data"]["shards"].push_back(two_shards["data"]["shards"][0]);
  two_shards["data"]["shards"][0]["tokens"] = std::numeric_limits<int64_t>::max();
  REQUIRE_INPUT_ERROR(manifest_of(two_shards), kManifestLabel, "data.shards[1].tokens");
  two_shards["data"]["shards"][0]["tokens"] = 10;
  two_shards["data"]["shards"][1]["dtype"] = "uint8";
  REQUIRE_INPUT_ERROR(manifest_of(two_shards), kManifestLabel, "data.shards[1].dtype");
}

TEST_CASE("manifest: bad steps and incident keys name the key", "[loaders][manifest]") {
  check_bad_cases(minimal_manifest(), {
      {"/steps", kRemove, "steps"},
      {"/steps", json::array(), "steps"},
      {"/steps/0", 0, "steps[0]"},
      {"/steps/0/step", kRemove, "steps[0].step"},
      {"/steps/0/step", -1, "steps[0].step"},
      {"/steps/0/step", "0", "steps[0].step"},
      {"/steps/0/dir", kRemove, "steps[0].dir"},
      {"/steps/0/dir", "../steps/0", "steps[0].dir"},
      {"/steps/0/dir", "/steps/0", "steps[0].dir"},
      {"/steps/0/samples", "all", "steps[0].samples"},
      {"/steps/0/samples", {1, 2}, "steps[0].samples[0]"},
      {"/steps/0/samples", {{0, -1}}, "steps[0].samples[0][1]"},
      {"/steps/0/samples", {{0, 1.5}}, "steps[0].samples[0][1]"},
      {"/incident", "step 5", "incident"},
      {"/incident/step", "5", "incident.step"},
      {"/incident/step", -5, "incident.step"},
      {"/incident/symptom", 5, "incident.symptom"},
  });
}

TEST_CASE("manifest: a duplicate step names the later entry", "[loaders][manifest]") {
  json manifest = minimal_manifest();
  manifest["steps"] = R"([{"step": 4, "dir": "a"}, {"step": 9, "dir": "b"},
                          {"step": 4, "dir": "c"}])"_json;
  REQUIRE_INPUT_ERROR(manifest_of(manifest), kManifestLabel, "steps[2].step", "step 4", "steps[0]");
}

TEST_CASE("manifest: the explicit sampler needs samples on every step", "[loaders][manifest]") {
  json manifest = manifest_with(minimal_manifest(), "/data/sampler", {{"kind", "explicit"}});
  manifest["steps"] = R"([{"step": 1, "dir": "a", "samples": [[0, 1]]},
                          {"step": 2, "dir": "b"}])"_json;
  REQUIRE_INPUT_ERROR(manifest_of(manifest), kManifestLabel, "steps[1].samples", "explicit");
}

TEST_CASE("manifest: text that is not a JSON object names the file", "[loaders][manifest]") {
  REQUIRE_INPUT_ERROR(nanreplay::parse_manifest("", kManifestLabel), kManifestLabel, "byte");
  REQUIRE_INPUT_ERROR(nanreplay::parse_manifest("{\"format\": ", kManifestLabel), kManifestLabel, "invalid JSON");
  REQUIRE_INPUT_ERROR(nanreplay::parse_manifest("[1, 2]", kManifestLabel), kManifestLabel, "expected a JSON object");
  REQUIRE_INPUT_ERROR(nanreplay::parse_manifest("{\"format\": \"nanreplay.bundle\"} x", kManifestLabel),
                      kManifestLabel, "invalid JSON");
}

TEST_CASE("manifest: arch and compute names print as written", "[loaders][manifest]") {
  CHECK(std::string(nanreplay::arch_name(nanreplay::Arch::kLlama)) == "llama");
  CHECK(std::string(nanreplay::arch_name(nanreplay::Arch::kGpt2)) == "gpt2");
  CHECK(std::string(nanreplay::compute_name(nanreplay::Compute::kFp32)) == "fp32");
  CHECK(std::string(nanreplay::compute_name(nanreplay::Compute::kFp8)) == "fp8");
}

// ---- json_util: the guarded parser and typed accessors ---------------------

TEST_CASE("json_util: invalid UTF-8 is rejected with its byte offset", "[loaders][json]") {
  const std::string cases[] = {
      std::string("{\"a\": \"") + "\xff" + "\"}",              // never valid
      std::string("{\"a\": \"") + "\xc3" + "\"}",              // truncated sequence
      std::string("{\"a\": \"") + "\xc0\xaf" + "\"}",          // overlong '/'
      std::string("{\"a\": \"") + "\xed\xa0\x80" + "\"}",      // UTF-16 surrogate
      std::string("{\"a\": \"") + "\xf4\x90\x80\x80" + "\"}",  // above U+10FFFF
  };
  for (const std::string& text : cases) {
    REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded(text, "x.json"), "x.json", "byte 7", "UTF-8");
  }
  REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded("\xff", "x.json", 64, 8), "x.json: byte 8");
  CHECK(nanreplay::parse_json_guarded("{\"a\": \"caf\xc3\xa9 \xf0\x9f\x94\xa5\"}", "x.json")["a"] ==
        "caf\xc3\xa9 \xf0\x9f\x94\xa5");
}

TEST_CASE("json_util: nesting is bounded before parsing", "[loaders][json]") {
  const std::string million(1000000, '[');
  REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded(million, "deep.json"), "deep.json", "byte 64",
                      "nested");
  const std::string objects = [] {
    std::string text;
    for (int i = 0; i < 100000; ++i) text += "{\"a\":";
    return text;
  }();
  REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded(objects, "deep.json"), "deep.json", "nested");

  const std::string at_limit = std::string(64, '[') + std::string(64, ']');
  CHECK_NOTHROW(nanreplay::parse_json_guarded(at_limit, "ok.json"));
  REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded("[" + at_limit + "]", "deep.json"),
                      "deep.json");
  // Text over the size limit is refused before any scanning.
  const std::string huge(nanreplay::kMaxJsonBytes + 1, ' ');
  REQUIRE_INPUT_ERROR(nanreplay::parse_json_guarded(huge, "huge.json"), "huge.json", "256 MiB");
  // Brackets inside strings (even after escaped quotes) are not nesting.
  const std::string in_string = "[\"\\\"" + std::string(100, '[') + "\"]";
  CHECK_NOTHROW(nanreplay::parse_json_guarded(in_string, "ok.json"));
}

TEST_CASE("json_util: integers are integers, numbers may be non-finite", "[loaders][json]") {
  const json doc = R"({"i": 3, "neg": -4, "f": 3.5, "whole": 3.0, "b": true, "s": "3",
                       "big": 18446744073709551615, "nan": "nan", "NaN": "NaN",
                       "inf": "Infinity", "ninf": "-inf", "word": "many", "null": null,
                       "arr": [], "obj": {}})"_json;
  const nanreplay::JsonReader reader(doc, "f.json", "root");
  CHECK(reader.integer("i") == 3);
  CHECK(reader.integer("neg") == -4);
  for (const char* key : {"f", "whole", "b", "s", "big", "null", "arr"}) {
    CAPTURE(key);
    REQUIRE_INPUT_ERROR(reader.integer(key), "f.json", std::string("root.") + key, "integer");
  }
  CHECK(reader.number("f") == 3.5);
  CHECK(reader.number("i") == 3.0);
  CHECK(std::isnan(reader.number("nan")));
  CHECK(std::isnan(reader.number("NaN")));
  CHECK(reader.number("inf") == std::numeric_limits<double>::infinity());
  CHECK(reader.number("ninf") == -std::numeric_limits<double>::infinity());
  for (const char* key : {"word", "b", "null", "obj"}) {
    CAPTURE(key);
    REQUIRE_INPUT_ERROR(reader.number(key), "f.json", std::string("root.") + key, "number");
  }
  REQUIRE_INPUT_ERROR(reader.boolean("i"), "root.i", "true or false");
  REQUIRE_INPUT_ERROR(reader.string("i"), "root.i", "string");
  REQUIRE_INPUT_ERROR(reader.array("obj"), "root.obj", "array");
  REQUIRE_INPUT_ERROR(reader.object("arr"), "root.arr", "object");
  REQUIRE_INPUT_ERROR(reader.integer("missing"), "root.missing", "missing");
  CHECK_FALSE(reader.optional_integer("null").has_value());
  CHECK_FALSE(reader.optional_number("missing").has_value());
  CHECK_FALSE(reader.has("null"));
  CHECK(reader.has("arr"));
  REQUIRE_INPUT_ERROR(nanreplay::JsonReader(doc["arr"], "f.json", "arr"), "f.json: arr",
                      "expected a JSON object");
  CHECK(nanreplay::json_describe(json("x")) == "\"x\"");
  CHECK(nanreplay::json_describe(std::string(100, 'y')).size() < 60);
}

TEST_CASE("manifest_json writes back what parse_manifest reads", "[manifest][writer]") {
  json fp8 = example_manifest();
  fp8["precision"] = {{"compute", "fp8"}, {"fp8", {{"fwd", "e5m2"}, {"bwd", "e5m2"}, {"amax_history_len", 4}, {"margin", 1}}}};
  json annotated = minimal_manifest();
  annotated["data"]["sampler"] = {{"kind", "explicit"}};
  annotated["steps"][0]["samples"] = {{3, 4}};
  annotated["steps"][0]["original_samples"] = {{30, 40}};
  for (const json& original : {example_manifest(), minimal_manifest(), fp8, annotated}) {
    const nanreplay::Manifest m = manifest_of(original);
    const json written = nanreplay::manifest_json(m);
    const nanreplay::Manifest again = manifest_of(written);
    CHECK(nanreplay::manifest_json(again) == written);  // a fixed point
    CHECK(again.model.hidden_size == m.model.hidden_size);
    CHECK(again.model.norm_eps == m.model.norm_eps);
    CHECK(again.precision.compute == m.precision.compute);
    CHECK(again.data.sampler.kind == m.data.sampler.kind);
    CHECK(again.data.sampler.seed == m.data.sampler.seed);
    CHECK(again.data.shards[0].sha256 == m.data.shards[0].sha256);
    CHECK(again.steps[0].samples == m.steps[0].samples);
    CHECK(again.steps[0].original_samples == m.steps[0].original_samples);
    CHECK(again.optimizer.has_value() == m.optimizer.has_value());
    if (m.precision.fp8) CHECK(again.precision.fp8->fwd == "e5m2");
    if (m.incident) CHECK(again.incident->step == m.incident->step);
  }
}
