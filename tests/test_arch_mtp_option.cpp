// model.mtp (loaders/arch/mtp_option.h): its values refused by file and key,
// the options its blocks cannot be replayed with refused by name, and the
// parameters it brings listed after the model's in the bundle's order
// (probes/sites.cpp expected_parameters). The replay against Megatron-LM's
// arithmetic is tests/py/test_family_deepseek_mtp.py's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/manifest_writer.h"
#include "probes/sites.h"

namespace {

using nlohmann::json;

json mtp_test_manifest() {
  json manifest = R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "arch": "llama", "vocab_size": 32, "hidden_size": 16, "num_layers": 2,
               "num_heads": 2, "intermediate_size": 24, "max_seq_len": 8,
               "mtp": { "num_layers": 1, "loss_scale": 0.3 } },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint32", "tokens": 100 } ],
              "seq_len": 8, "micro_batch_size": 2,
              "sampler": { "kind": "randperm", "seed": 0 } },
    "steps": [ { "step": 0, "dir": "steps/0" } ]
  })"_json;
  return manifest;
}

nanreplay::Manifest parsed(const json& manifest) {
  return nanreplay::parse_manifest(manifest.dump(), "bundle/manifest.json");
}

// The one line a bad model.mtp gets: the file, then the key.
std::string refusal(const json& manifest) {
  try {
    parsed(manifest);
  } catch (const nanreplay::InputError& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("model.mtp is read, and its absence reads as no multi-token prediction", "[arch][options][mtp]") {
  const nanreplay::Manifest with = parsed(mtp_test_manifest());
  REQUIRE(with.model.mtp);
  CHECK(with.model.mtp->num_layers == 1);
  CHECK(with.model.mtp->loss_scale == 0.3);
  json without = mtp_test_manifest();
  without["model"].erase("mtp");
  CHECK_FALSE(parsed(without).model.mtp);
}

TEST_CASE("a wrong model.mtp is refused by file and key", "[arch][options][mtp][bad-input]") {
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"num_layers", 1}, {"loss_scale", -0.3}}, "bundle/manifest.json: model.mtp.loss_scale: expected a finite number > 0"},
      {{{"num_layers", 1}, {"loss_scale", 0}}, "bundle/manifest.json: model.mtp.loss_scale: expected a finite number > 0"},
      {{{"num_layers", 1}}, "bundle/manifest.json: model.mtp.loss_scale"},
      {{{"loss_scale", 0.1}}, "bundle/manifest.json: model.mtp.num_layers"},
      {{{"num_layers", 0}, {"loss_scale", 0.1}}, "bundle/manifest.json: model.mtp.num_layers: expected a positive integer"},
      {{{"num_layers", 65}, {"loss_scale", 0.1}}, "bundle/manifest.json: model.mtp.num_layers: expected at most 64"},
      {{{"num_layers", 1}, {"loss_scale", 0.1}, {"detach_heads", true}}, "bundle/manifest.json: model.mtp.detach_heads: is not an mtp key"},
      {json(3), "bundle/manifest.json: model.mtp"},
  };
  for (const auto& [mtp, expected] : cases) {
    INFO(mtp.dump());
    json manifest = mtp_test_manifest();
    manifest["model"]["mtp"] = mtp;
    CHECK_THAT(refusal(manifest), Catch::StartsWith(expected));
  }
}

TEST_CASE("model.mtp beside an option its blocks have no entry in is refused by name", "[arch][options][mtp][bad-input]") {
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"layer_types", json::array({"full_attention", "full_attention"})},
           {"no_rope_layers", json::array({1, 1})},
           {"moe", {{"num_experts", 4}, {"top_k", 2}}}}) {
    INFO(key);
    json manifest = mtp_test_manifest();
    manifest["model"][key] = value;
    CHECK_THAT(refusal(manifest), Catch::StartsWith("bundle/manifest.json: model.mtp: not replayed together with model." + key));
  }
  json gpt2 = mtp_test_manifest();
  gpt2["model"]["arch"] = "gpt2";
  gpt2["model"]["intermediate_size"] = 64;
  CHECK_THAT(refusal(gpt2), Catch::Contains("model.mtp"));
}

TEST_CASE("model.mtp's parameters follow the model's, depth by depth, under Hugging Face's names", "[arch][mtp]") {
  const nanreplay::Manifest m = parsed(mtp_test_manifest());
  const std::vector<nanreplay::ParamSpec> params = nanreplay::expected_parameters(m.model);
  json plain = mtp_test_manifest();
  plain["model"].erase("mtp");
  const size_t model_params = nanreplay::expected_parameters(parsed(plain).model).size();
  std::vector<std::string> names;
  for (size_t i = model_params; i < params.size(); ++i) names.push_back(params[i].name);
  const std::vector<std::string> expected = {
      "model.layers.2.enorm.weight",           "model.layers.2.hnorm.weight",
      "model.layers.2.eh_proj.weight",         "model.layers.2.input_layernorm.weight",
      "model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
      "model.layers.2.self_attn.v_proj.weight", "model.layers.2.self_attn.o_proj.weight",
      "model.layers.2.post_attention_layernorm.weight", "model.layers.2.mlp.gate_proj.weight",
      "model.layers.2.mlp.up_proj.weight",     "model.layers.2.mlp.down_proj.weight",
      "model.layers.2.shared_head.norm.weight"};
  CHECK(names == expected);
  CHECK(params[model_params + 2].shape == std::vector<int64_t>{16, 32});  // eh_proj: Linear(2C, C)
  CHECK(params[model_params].shape == std::vector<int64_t>{16});
}

TEST_CASE("model.moe.layers may list the MTP blocks' layers, which then hold the experts", "[arch][options][mtp]") {
  json manifest = mtp_test_manifest();
  manifest["model"]["moe"] = {{"num_experts", 2}, {"top_k", 1}, {"layers", {1, 2}}};
  const nanreplay::Manifest m = parsed(manifest);
  REQUIRE(m.model.moe);
  CHECK(m.model.moe->layers == std::vector<int>{1, 2});
  CHECK(nanreplay::manifest_json(m)["model"]["moe"]["layers"] == json({1, 2}));  // written back whole
  std::vector<std::string> names;
  for (const nanreplay::ParamSpec& spec : nanreplay::expected_parameters(m.model)) names.push_back(spec.name);
  const auto has = [&](const std::string& name) { return std::find(names.begin(), names.end(), name) != names.end(); };
  CHECK(has("model.layers.2.mlp.gate.weight"));
  CHECK(has("model.layers.2.mlp.experts.1.down_proj.weight"));
  CHECK_FALSE(has("model.layers.2.mlp.gate_proj.weight"));
  CHECK(has("model.layers.0.mlp.gate_proj.weight"));
}

TEST_CASE("model.moe.layers past the MTP blocks, or MTP experts with what is not replayed for them, is refused",
          "[arch][options][mtp][bad-input]") {
  json past = mtp_test_manifest();
  past["model"]["moe"] = {{"num_experts", 2}, {"top_k", 1}, {"layers", {1, 3}}};
  CHECK_THAT(refusal(past), Catch::StartsWith("bundle/manifest.json: model.moe.layers: layer 3 is past"));
  json no_mtp = past;
  no_mtp["model"].erase("mtp");
  no_mtp["model"]["moe"]["layers"] = {2};
  CHECK_THAT(refusal(no_mtp), Catch::StartsWith("bundle/manifest.json: model.moe.layers[0]: expected a layer index in [0, 2)"));
  json aux = mtp_test_manifest();
  aux["model"]["moe"] = {{"num_experts", 2}, {"top_k", 1}, {"layers", {2}}, {"router_aux_loss_coef", 0.01}};
  CHECK_THAT(refusal(aux), Catch::StartsWith("bundle/manifest.json: model.moe.router_aux_loss_coef: not replayed"));
  aux["model"]["moe"]["router_aux_loss_coef"] = 0;
  aux["model"]["moe"]["router_z_loss_coef"] = 0.001;
  CHECK_THAT(refusal(aux), Catch::Contains("model.moe.router_z_loss_coef: not replayed for the MTP blocks"));
  aux["model"]["moe"]["layers"] = {1};  // the decoder's only: its router loss is replayed
  CHECK(refusal(aux) == "accepted");
}

TEST_CASE("score_bias_update with an MTP block's experts is accepted: its bias is derived as a decoder layer's",
          "[arch][options][mtp]") {
  json manifest = mtp_test_manifest();
  manifest["model"]["moe"] = {{"num_experts", 4},          {"top_k", 2},
                              {"layers", {1, 2}},          {"router", "sigmoid_grouped"},
                              {"n_group", 2},              {"topk_group", 1},
                              {"routed_scaling_factor", 1}, {"norm_topk_prob", true},
                              {"score_bias_update", {{"rule", "sign_centred"}, {"rate", 0.001}}}};
  CHECK(refusal(manifest) == "accepted");
  manifest["model"]["moe"]["router_z_loss_coef"] = 0.001;  // the MTP block's router loss stays refused
  CHECK_THAT(refusal(manifest), Catch::Contains("model.moe.router_z_loss_coef: not replayed for the MTP blocks"));
}
