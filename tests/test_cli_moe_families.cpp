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
using nanreplay_test::run_bundle;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::Triaged;

TEST_CASE("GPT-OSS experts without the clamp: run and bisect name the expert whose activation overflows; "
          "swiglu-clamp=7 resolves it",
          "[cli][moe][incident][what-if]") {
  ScratchDir dir("moe-gpt-oss-overflow");
  const auto synth = run_cli({"synth", "gpt-oss-expert-overflow", (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  const nlohmann::json planted = nlohmann::json::parse(synth.out);
  // One run with the what-if; run_bundle also checks that bisect names run's origin.
  const Triaged t = run_bundle(dir, {"--what-if", "swiglu-clamp=7"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  // gate and up are a few hundred, finite; (up + 1) * gate * sigmoid(alpha * gate) passes fp16's 65504.
  CHECK(first["site"] == "layers.1.mlp.expert.act");
  CHECK(first["expert"] == planted["fault_expert"]);
  CHECK(first["expert"] == 2);
  CHECK(first["kind"] == "inf");
  CHECK(first["step"] == planted["fault_step"]);
  CHECK(first["sample"] == planted["fault_sample"]);
  CHECK(first["position"] == planted["fault_position"]);
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
