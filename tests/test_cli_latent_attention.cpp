// DeepSeek-V3's multi-head latent attention (model.latent_attention,
// docs/bundle-format.md "Multi-head latent attention"): its parameters and
// sites by the tables, and through the CLI each bad or conflicting value as
// one error line naming the file and key. The numbers are cross-checked
// against eager PyTorch in tests/py/test_family_deepseek_mla.py.
#include <catch2/catch.hpp>

#include <fstream>

#include "probes/sites.h"
#include "replay/step/memory_estimate.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

// clean-deepseek-mla's bundle with its manifest's model object changed by `edit`.
std::filesystem::path latent_bundle(const ScratchDir& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::filesystem::path bundle = dir / "bundle";
  if (!std::filesystem::exists(bundle / "manifest.json")) {
    REQUIRE(run_cli({"synth", "clean-deepseek-mla", bundle.string()}).status == 0);
    std::filesystem::copy_file(bundle / "manifest.json", dir / "manifest.orig");
  }
  nlohmann::json manifest = read_json(dir / "manifest.orig");
  edit(manifest["model"]);
  std::ofstream(bundle / "manifest.json") << manifest.dump(2);
  return bundle;
}

}  // namespace

TEST_CASE("latent attention's parameters and sites replace q/k/v_proj's, in Hugging Face's order", "[latent]") {
  nanreplay::ModelConfig m = nanreplay::synthetic_preset("clean-deepseek-mla").model;
  std::vector<std::pair<std::string, std::vector<int64_t>>> layer0;
  for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(m)) {
    if (p.name.rfind("model.layers.0.self_attn.", 0) == 0) layer0.emplace_back(p.name.substr(25), p.shape);
  }
  using Shape = std::vector<int64_t>;
  CHECK(layer0 == std::vector<std::pair<std::string, Shape>>{{"q_a_proj.weight", {16, 32}},
                                                              {"q_a_layernorm.weight", {16}},
                                                              {"q_b_proj.weight", {4 * 12, 16}},
                                                              {"kv_a_proj_with_mqa.weight", {8 + 4, 32}},
                                                              {"kv_a_layernorm.weight", {8}},
                                                              {"kv_b_proj.weight", {4 * 16, 8}},
                                                              {"o_proj.weight", {32, 4 * 8}}});
  std::vector<std::string> sites;
  for (const nanreplay::SiteRef& s : nanreplay::forward_sites(m)) {
    if (s.layer == 0) sites.push_back(nanreplay::site_name(s));
  }
  REQUIRE(sites.size() > 5);
  CHECK(std::vector<std::string>(sites.begin() + 2, sites.begin() + 5) ==
        std::vector<std::string>{"layers.0.attn.q_latent", "layers.0.attn.kv_latent", "layers.0.attn.q"});
  // The memory estimate counts what the table lists, with and without q's latent.
  const auto check_count = [](const nanreplay::ModelConfig& model) {
    double elements = 0;
    for (const nanreplay::ParamSpec& p : nanreplay::expected_parameters(model)) {
      double n = 1;
      for (int64_t dim : p.shape) n *= static_cast<double>(dim);
      elements += n;
    }
    CHECK(nanreplay::count_model_parameters(model).elements == elements);
    CHECK(nanreplay::count_model_parameters(model).tensors == static_cast<double>(nanreplay::expected_parameters(model).size()));
  };
  check_count(m);
  m.latent_attention->q_lora_rank = 0;  // null: a plain q_proj, no q latent
  check_count(m);
  CHECK(nanreplay::expected_parameters(m)[2].name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(nanreplay::expected_parameters(m)[2].shape == Shape{4 * 12, 32});
  for (const nanreplay::SiteRef& s : nanreplay::forward_sites(m)) CHECK(s.id != nanreplay::SiteId::kAttnQLatent);
}

TEST_CASE("latent attention: a bad or conflicting value is one error line naming the key", "[latent][cli]") {
  ScratchDir dir("latent-refusals");
  const auto inspect = [&](const std::function<void(nlohmann::json&)>& edit) {
    return run_cli({"inspect", latent_bundle(dir, edit).string()});
  };
  check_one_error_line(inspect([](nlohmann::json& m) { m["qk_norm"] = "head"; }),
                       {"manifest.json", "model.latent_attention", "model.qk_norm"});
  check_one_error_line(inspect([](nlohmann::json& m) { m["num_kv_heads"] = 2; }),
                       {"manifest.json", "model.latent_attention", "num_kv_heads"});
  check_one_error_line(inspect([](nlohmann::json& m) { m["latent_attention"].erase("q_lora_rank"); }),
                       {"manifest.json", "model.latent_attention.q_lora_rank", "null"});
  check_one_error_line(inspect([](nlohmann::json& m) { m["latent_attention"]["qk_rope_head_dim"] = 3; }),
                       {"model.latent_attention.qk_rope_head_dim", "even"});
  check_one_error_line(inspect([](nlohmann::json& m) { m["latent_attention"]["rope_interleave"] = true; }),
                       {"model.latent_attention.rope_interleave", "not a latent_attention key"});
  // q_lora_rank null asks for q_proj, which the checkpoint (q_a_proj, q_b_proj) has not.
  const auto plain_q = latent_bundle(dir, [](nlohmann::json& m) { m["latent_attention"]["q_lora_rank"] = nullptr; });
  check_one_error_line(run_cli({"run", plain_q.string(), "--out", (dir / "o").string()}),
                       {"model.safetensors", "self_attn.q_proj.weight"});
  const auto bundle = latent_bundle(dir, [](nlohmann::json&) {});
  check_one_error_line(run_cli({"run", bundle.string(), "--out", (dir / "o").string(), "--what-if", "qk-norm"}),
                       {"qk-norm", "latent_attention"});
  CHECK_FALSE(std::filesystem::exists(dir / "o"));
}
