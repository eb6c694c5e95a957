// The model option table (loaders/arch/model_options.h), row by row: every
// llama option is read and written back exactly, written only when it is not
// the default, refused by name on gpt2, and known by the same key to the
// capture helper (capture/nanreplay_capture.py) and to the importer
// (capture/nanreplay_import/). A new row fails here until it has an example
// value below and both Python helpers list its key.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/arch/model_options.h"
#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/manifest_writer.h"
#include "tests/cli_harness.h"

namespace {

using nlohmann::json;

// One value other than the default per llama option, in the form the writer writes it.
const std::map<std::string, json>& option_examples() {
  static const std::map<std::string, json> examples = {
      {"rope_style", "interleaved"},
      {"rope_scaling",
       {{"rope_type", "llama3"},
        {"factor", 8.0},
        {"low_freq_factor", 1.0},
        {"high_freq_factor", 4.0},
        {"original_max_position_embeddings", 32}}},
      {"attention_bias", true},
      {"o_proj_bias", true},
      {"attention_sinks", true},
      {"no_rope_layers", json::array({0})},
      {"attn_temperature_tuning", {{"floor_scale", 8192.0}, {"attn_scale", 0.1}}},
      {"attention_chunk_size", 8},
      {"qk_norm", "full"},
      {"attn_logit_softcap", 30.5},
      {"final_logit_softcap", 15.0},
      {"sliding_window", 4},
      {"head_dim", 12},
      {"partial_rotary_factor", 0.5},
      {"attention_mask", "additive_neg_inf"},
      {"norm_layout", "post"},
      {"layer_types", json::array({"full_attention"})},
      {"rope_local_base_freq", 10000.0},
      {"rms_norm_offset", true},
      {"scale_embeddings", true},
      {"query_pre_attn_scalar", 24.0},
      {"hidden_act", "gelu_pytorch_tanh"},
      {"moe",
       {{"num_experts", 4},
        {"top_k", 2},
        {"intermediate_size", 24},
        {"norm_topk_prob", true},
        {"router_aux_loss_coef", 0.01},
        {"router_z_loss_coef", 0.001}}},
      {"latent_attention",
       {{"q_lora_rank", 8},
        {"kv_lora_rank", 4},
        {"qk_nope_head_dim", 4},
        {"qk_rope_head_dim", 4},
        {"v_head_dim", 6},
        {"norm_eps", 1e-6}}},
      {"mtp", {{"num_layers", 1}, {"loss_scale", 0.3}}},
  };
  return examples;
}

std::vector<std::string> table_keys(nanreplay::Arch arch) {
  std::vector<std::string> keys;
  for (const nanreplay::ModelOption& option : nanreplay::model_family(arch).options) keys.push_back(option.key);
  return keys;
}

json options_test_manifest(const std::string& arch) {
  json manifest = R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "vocab_size": 32, "hidden_size": 16, "num_layers": 1,
               "num_heads": 2, "max_seq_len": 8 },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint32", "tokens": 100 } ],
              "seq_len": 8, "micro_batch_size": 2,
              "sampler": { "kind": "randperm", "seed": 0 } },
    "steps": [ { "step": 0, "dir": "steps/0" } ]
  })"_json;
  manifest["model"]["arch"] = arch;
  if (arch == "llama") manifest["model"]["intermediate_size"] = 40;
  return manifest;
}

// The model object parse_manifest reads and manifest_json writes back.
json model_round_trip(const json& manifest) {
  const nanreplay::Manifest parsed = nanreplay::parse_manifest(manifest.dump(), "bundle/manifest.json");
  return nanreplay::manifest_json(parsed)["model"];
}

// The keys a Python helper lists, by the expression that gives them.
std::vector<std::string> python_option_keys(const std::string& expression) {
  nanreplay_test::ScratchDir dir("option-keys");
  const std::string capture = std::string(NANREPLAY_SOURCE_DIR) + "/capture";
  std::ofstream(dir / "keys.py") << "import json, sys\nsys.path.insert(0, " << json(capture).dump()
                                 << ")\nimport nanreplay_capture\nimport nanreplay_import\nprint(json.dumps(list("
                                 << expression << ")))\n";
  const std::string cmd = std::string(NANREPLAY_PYTHON) + " " +
                          nanreplay_test::shell_quote((dir / "keys.py").string()) +
                          " > " + nanreplay_test::shell_quote((dir / "keys.json").string());
  REQUIRE(std::system(cmd.c_str()) == 0);
  return json::parse(nanreplay_test::slurp(dir / "keys.json")).get<std::vector<std::string>>();
}

}  // namespace

TEST_CASE("every llama option has an example here", "[arch][options]") {
  std::vector<std::string> examples;
  for (const auto& [key, value] : option_examples()) examples.push_back(key);
  std::vector<std::string> keys = table_keys(nanreplay::Arch::kLlama);
  std::sort(keys.begin(), keys.end());
  CHECK(keys == examples);
  CHECK(table_keys(nanreplay::Arch::kGpt2).empty());
}

TEST_CASE("each llama option is read and written back as given, and not written at its default",
          "[arch][options]") {
  const json plain = model_round_trip(options_test_manifest("llama"));
  for (const std::string& key : table_keys(nanreplay::Arch::kLlama)) {
    INFO(key);
    CHECK_FALSE(plain.contains(key));
    json manifest = options_test_manifest("llama");
    manifest["model"][key] = option_examples().at(key);
    CHECK(model_round_trip(manifest)[key] == option_examples().at(key));
    manifest["model"][key] = nullptr;  // null is the default, as absent
    CHECK_FALSE(model_round_trip(manifest).contains(key));
  }
  // Every option at once, but Gemma's GeGLU (the mixture of experts refuses it: its experts are silu) and
  // latent attention (it refuses the QK-norm, head_dim and the other attention options it has no part of), and
  // multi-token prediction (it refuses the per-layer lists, which have no entry for its blocks).
  const auto left_out = [](const std::string& key) {
    return key == "hidden_act" || key == "latent_attention" || key == "mtp";
  };
  json all = options_test_manifest("llama");
  for (const auto& [key, value] : option_examples()) {
    if (!left_out(key)) all["model"][key] = value;
  }
  const json written = model_round_trip(all);
  for (const auto& [key, value] : option_examples()) CHECK(written.value(key, json()) == (left_out(key) ? json() : value));
}

TEST_CASE("rope_scaling yarn is written back with Hugging Face's defaults filled; llama3 takes equal factors",
          "[arch][options]") {
  json manifest = options_test_manifest("llama");
  manifest["model"]["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 32.0}, {"original_max_position_embeddings", 4096}};
  const json written = model_round_trip(manifest)["rope_scaling"];
  CHECK(written == json{{"rope_type", "yarn"}, {"factor", 32.0}, {"original_max_position_embeddings", 4096},
                        {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"truncate", true}});
  manifest["model"]["rope_scaling"] = {{"type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096},
                                       {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"truncate", false}};
  const json deepseek = model_round_trip(manifest)["rope_scaling"];
  CHECK(deepseek["mscale"] == 1.0);
  CHECK(deepseek["truncate"] == false);
  nanreplay::RopeScaling yarn;
  yarn.type = nanreplay::RopeScalingType::kYarn;
  yarn.factor = 32.0;
  CHECK(nanreplay::yarn_attention_factor(yarn) == Approx(0.1 * std::log(32.0) + 1.0).epsilon(1e-15));
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 1.0;  // DeepSeek-V3: the two cancel
  CHECK(nanreplay::yarn_attention_factor(yarn) == 1.0);
  yarn.attention_factor = 0.5;
  CHECK(nanreplay::yarn_attention_factor(yarn) == 0.5);
  // Llama 4: low_freq_factor == high_freq_factor, no blended band.
  manifest["model"]["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 16.0}, {"low_freq_factor", 1.0},
                                       {"high_freq_factor", 1.0}, {"original_max_position_embeddings", 8192}};
  CHECK(model_round_trip(manifest)["rope_scaling"]["high_freq_factor"] == 1.0);
}

TEST_CASE("gpt2 refuses each llama option by its key", "[arch][options]") {
  for (const std::string& key : table_keys(nanreplay::Arch::kLlama)) {
    INFO(key);
    json manifest = options_test_manifest("gpt2");
    manifest["model"][key] = option_examples().at(key);
    const std::string expected = "bundle/manifest.json: model." + key +
                                 ": is a llama-family option; gpt2 (nanoGPT's model) has none, got " +
                                 nanreplay::json_describe(option_examples().at(key));
    CHECK_THROWS_WITH(model_round_trip(manifest), expected);
  }
}

TEST_CASE("the capture helper and the importer know every llama option by its key", "[arch][options][capture]") {
  const std::vector<std::string> keys = table_keys(nanreplay::Arch::kLlama);
  CHECK(python_option_keys("nanreplay_capture.LLAMA_OPTION_KEYS") == keys);
  CHECK(python_option_keys("nanreplay_import.model_settle.LLAMA_OPTION_KEYS") == keys);
}
