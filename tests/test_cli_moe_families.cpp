// The frontier mixtures of experts (issue 40; docs/bundle-format.md, "Mixture
// of experts") through the CLI: an incident in GPT-OSS's experts named by run
// and bisect, the swiglu-clamp what-if that resolves it, and bad model.moe keys
// refused by name. The numbers are cross-checked against eager PyTorch in
// tests/py/test_family_gpt_oss_moe.py.
#include <catch2/catch.hpp>

#include <fstream>

#include "tests/triage_harness.h"

using nanreplay_test::check_one_error_line;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::triage;
using nanreplay_test::Triaged;

TEST_CASE("GPT-OSS experts without the clamp: run and bisect name the expert whose activation overflows; "
          "swiglu-clamp=7 resolves it",
          "[cli][moe][incident][what-if]") {
  ScratchDir dir("moe-gpt-oss-overflow");
  // One run with the what-if; run_bundle also checks that bisect names run's origin.
  const Triaged t = triage(dir, "gpt-oss-expert-overflow", {}, {"--what-if", "swiglu-clamp=7"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  // gate and up are a few hundred, finite; (up + 1) * gate * sigmoid(alpha * gate) passes fp16's 65504.
  CHECK(first["site"] == "layers.1.mlp.expert.act");
  CHECK(first["expert"] == t.planted["fault_expert"]);
  CHECK(first["expert"] == 2);
  CHECK(first["kind"] == "inf");
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  CHECK(t.verdict.find("| expert 2 |") != std::string::npos);
  const nlohmann::json outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 1);
  CHECK(outcomes[0]["what_if"] == "swiglu-clamp=7");
  CHECK(outcomes[0]["resolved"] == true);
  CHECK(outcomes[0]["first_nonfinite_after"].is_null());
  CHECK(outcomes[0]["change"] ==
        "the experts' gate clamped to at most 7 and up to [-7, 7] before the activation");

  // Refused before anything is replayed: a limit <= 0; gpt_oss experts without their alpha.
  const std::string bundle = (dir / "bundle").string();
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "o2").string(), "--what-if", "swiglu-clamp=0"}),
                       {"swiglu-clamp=0", "> 0"});
  nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
  manifest["model"]["moe"].erase("swiglu_alpha");
  std::ofstream(dir / "bundle" / "manifest.json") << manifest.dump(2);
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "o3").string()}),
                       {"manifest.json", "model.moe.swiglu_alpha"});
  CHECK_FALSE(std::filesystem::exists(dir / "o3"));
}

// DeepSeek-V3's grouped router (router "sigmoid_grouped"): its correction bias travels per step in
// state.json (router_score_bias). Cross-checked against eager PyTorch in tests/py/test_family_deepseek_moe.py.
#include <cstdint>
#include <filesystem>
#include <limits>

namespace {

// Element 0 of `tensor` (stored F32) in a safetensors file set to NaN: an incident to replay.
void poison_deepseek_moe_tensor(const std::filesystem::path& file, const std::string& tensor) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_size = 0;
  io.read(reinterpret_cast<char*>(&header_size), 8);
  std::string header(header_size, '\0');
  io.read(header.data(), static_cast<std::streamsize>(header_size));
  const nlohmann::json entry = nlohmann::json::parse(header).at(tensor);
  REQUIRE(entry.at("dtype") == "F32");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  io.seekp(static_cast<std::streamoff>(8 + header_size + entry.at("data_offsets")[0].get<uint64_t>()));
  io.write(reinterpret_cast<const char*>(&nan), sizeof nan);
}

}  // namespace

TEST_CASE("DeepSeek-V3's router: a step without its correction bias is refused by name; router-bias=frozen "
          "replays the bad step with the previous step's bias",
          "[cli][moe][what-if]") {
  ScratchDir dir("moe-deepseek-bias");
  const auto synth = run_cli({"synth", "clean-deepseek-moe", (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  const std::string bundle = (dir / "bundle").string();
  const std::filesystem::path last = dir / "bundle" / "steps" / "103";
  // inspect names what makes the model DeepSeek-V3's: its router, shared expert and latent attention.
  const auto inspect = run_cli({"inspect", bundle});
  CHECK(nanreplay_test::contains(inspect.out, "experts    8 routed, top 2 (sigmoid_grouped router), a shared expert"));
  CHECK(nanreplay_test::contains(inspect.out, "attention  latent: kv rank "));
  const nlohmann::json summary = nlohmann::json::parse(run_cli({"inspect", bundle, "--json"}).out);
  CHECK(summary["model"]["moe"]["router"] == "sigmoid_grouped");
  CHECK(summary["model"]["latent_attention"].is_object());

  // A bad step: lm_head's first weight NaN in step 103's checkpoint. The what-if swaps the bias and runs.
  poison_deepseek_moe_tensor(last / "model.safetensors", "lm_head.weight");
  const auto run = run_cli({"run", bundle, "--out", (dir / "out").string(), "--what-if", "router-bias=frozen"});
  INFO(run.err);
  CHECK(run.status == 1);
  const nlohmann::json report = read_json(dir / "out" / "report.json");
  CHECK(report["first_nonfinite"]["step"] == 103);
  const nlohmann::json outcomes = report["what_if"];
  REQUIRE(outcomes.size() == 1);
  CHECK(outcomes[0]["what_if"] == "router-bias=frozen");
  CHECK(outcomes[0]["replays"].get<int>() > 0);
  CHECK(outcomes[0]["resolved"] == false);  // the NaN is in a weight, not the routing
  const std::string change = outcomes[0]["change"].get<std::string>();
  CHECK(change.find("correction bias of step 102 in place of step 103's") != std::string::npos);

  // A step whose state.json leaves a layer's bias out: one line naming the file and the key, exit 2.
  nlohmann::json state = read_json(last / "state.json");
  state["router_score_bias"].erase("model.layers.2.mlp.gate.e_score_correction_bias");
  std::ofstream(last / "state.json") << state.dump(2);
  check_one_error_line(run_cli({"run", bundle, "--out", (dir / "o2").string(), "--steps", "103"}),
                       {"steps/103/state.json", "router_score_bias[\"model.layers.2.mlp.gate.e_score_correction_bias\"]",
                        "required"});
  CHECK_FALSE(std::filesystem::exists(dir / "o2"));

  // The what-if on a model without the grouped router: refused by name before any replay.
  ScratchDir qwen("moe-deepseek-bias-qwen");
  REQUIRE(run_cli({"synth", "clean-moe", (qwen / "bundle").string()}).status == 0);
  check_one_error_line(run_cli({"run", (qwen / "bundle").string(), "--out", (qwen / "out").string(), "--what-if",
                                "router-bias=frozen"}),
                       {"router-bias=frozen", "sigmoid_grouped"});
}
