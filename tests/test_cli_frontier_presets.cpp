// Incidents in issue 40's frontier layers through the CLI: one head of
// DeepSeek-V3's latent attention (deepseek-mla-overflow) and one routed expert
// of a Llama 4 or DeepSeek-V3 MoE layer (llama4-moe-overflow,
// deepseek-moe-overflow). `run` and `bisect` name the
// same origin (step, site, layer, head or expert, sample, position); one
// what-if resolves it, one does not. The clean models are cross-checked against
// eager PyTorch in tests/py/test_family_deepseek_mla.py and
// tests/py/test_family_llama4_moe.py.
#include <catch2/catch.hpp>

#include "tests/triage_harness.h"

using nanreplay_test::ScratchDir;
using nanreplay_test::triage;
using nanreplay_test::Triaged;

namespace {

// `preset` replayed by run with `what_ifs` (run_bundle checks that bisect names run's origin).
Triaged frontier_incident(const ScratchDir& dir, const std::string& preset, const std::vector<std::string>& what_ifs) {
  std::vector<std::string> run_extra;
  for (const std::string& w : what_ifs) {
    run_extra.push_back("--what-if");
    run_extra.push_back(w);
  }
  return triage(dir, preset, {}, run_extra);
}

// The first non-finite value is the planted expert's up projection in layer 1, at its step, sample and position.
void check_planted_expert_origin(const Triaged& t) {
  const nlohmann::json& first = t.report["first_nonfinite"];
  CHECK(first["site"] == "layers.1.mlp.expert.up");
  CHECK(first["layer"] == 1);
  CHECK(first["expert"] == t.planted["fault_expert"]);
  CHECK(first["kind"] == "inf");
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
}

}  // namespace

TEST_CASE("DeepSeek-V3 latent attention: run and bisect name the one head whose scores overflow; fp32 resolves it, "
          "a soft cap cannot",
          "[cli][options][incident][what-if][frontier]") {
  ScratchDir dir("frontier-mla-overflow");
  const Triaged t = frontier_incident(dir, "deepseek-mla-overflow", {"fp32-layers=1", "softcap=30"});
  CHECK(t.status == 1);
  const nlohmann::json& first = t.report["first_nonfinite"];
  // Only head 2's nope rows of q_b_proj and kv_b_proj read the token's latent dimension.
  CHECK(first["site"] == "layers.1.attn.scores");
  CHECK(first["layer"] == 1);
  CHECK(first["head"] == 2);
  CHECK(first["kind"] == "inf");
  CHECK(first["step"] == t.planted["fault_step"]);
  CHECK(first["sample"] == t.planted["fault_sample"]);
  CHECK(first["position"] == t.planted["fault_position"]);
  CHECK(t.report["reproduction"]["reproduces"] == true);
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["what_if"] == "fp32-layers=1");
  CHECK(outcomes[0]["resolved"] == true);  // q_nope . k_nope, a few million, fits fp32
  CHECK(outcomes[1]["what_if"] == "softcap=30");
  CHECK(outcomes[1]["resolved"] == false);  // q k^T overflows before any cap reads it
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.attn.scores");
}

TEST_CASE("Llama 4 MoE: run and bisect name the routed expert whose up projection overflows; fp32 in its layer "
          "resolves it, in the dense layer it does not",
          "[cli][moe][incident][what-if][frontier]") {
  ScratchDir dir("frontier-llama4-moe-overflow");
  const Triaged t = frontier_incident(dir, "llama4-moe-overflow", {"fp32-layers=1", "fp32-layers=0"});
  CHECK(t.status == 1);
  check_planted_expert_origin(t);
  CHECK(t.report["first_nonfinite"]["expert"] == 2);
  CHECK(t.verdict.find("| expert 2 |") != std::string::npos);
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["what_if"] == "fp32-layers=1");
  CHECK(outcomes[0]["resolved"] == true);  // 60000 times the token's normalised feature fits fp32
  CHECK(outcomes[1]["what_if"] == "fp32-layers=0");
  CHECK(outcomes[1]["resolved"] == false);  // layer 0 is dense: the expert of layer 1 still overflows
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.mlp.expert.up");
}

TEST_CASE("DeepSeek-V3 MoE: run and bisect name the routed expert whose up projection overflows; fp32 in the layers "
          "from it on resolves it, the previous step's router bias does not",
          "[cli][moe][incident][what-if][frontier]") {
  ScratchDir dir("frontier-deepseek-moe-overflow");
  const Triaged t = frontier_incident(dir, "deepseek-moe-overflow", {"fp32-layers=1,2", "router-bias=frozen"});
  CHECK(t.status == 1);
  check_planted_expert_origin(t);
  const nlohmann::json& outcomes = t.report["what_if"];
  REQUIRE(outcomes.size() == 2);
  CHECK(outcomes[0]["what_if"] == "fp32-layers=1,2");
  CHECK(outcomes[0]["resolved"] == true);
  // The grouped router picks expert 2 for the token whatever the step's correction bias.
  CHECK(outcomes[1]["what_if"] == "router-bias=frozen");
  CHECK(outcomes[1]["resolved"] == false);
  CHECK(outcomes[1]["first_nonfinite_after"]["site"] == "layers.1.mlp.expert.up");
}
