// NUMERIC_ROUTER_COLLAPSE from per-layer token counts (reports/triage/numeric/expert_load.h):
// the collapse point, a starved expert, what is not a collapse, and the
// counts read back from per-expert probe records.
#include <catch2/catch.hpp>

#include "reports/triage/numeric/expert_load.h"

using nanreplay::collapsed_share;
using nanreplay::expert_share;
using nanreplay::expert_token_counts;
using nanreplay::Finding;
using nanreplay::MoeConfig;
using nanreplay::router_collapse_findings;

namespace {

MoeConfig four_top_two() { return MoeConfig{4, 2, 16, true, 0.0, 0.0}; }

using K = nanreplay::EvidenceKey;

}  // namespace

TEST_CASE("the collapse point: four times the balanced share, at most 80% of the way to every token", "[moe][triage]") {
  CHECK(collapsed_share(2, 4) == Approx(0.9));    // balanced 50%
  CHECK(collapsed_share(2, 8) == Approx(0.85));   // balanced 25%
  CHECK(collapsed_share(8, 64) == Approx(0.5));   // balanced 12.5%
  CHECK(collapsed_share(1, 8) == Approx(0.5));
  CHECK(expert_share({30, 10, 10, 10}, 0, 2) == Approx(1.0));  // 60 slots = 30 tokens, expert 0 saw each
  CHECK(expert_share({0, 0, 0, 0}, 1, 2) == 0.0);
}

TEST_CASE("NUMERIC_ROUTER_COLLAPSE: one expert over the collapse point, or one starved, per layer", "[moe][triage]") {
  const MoeConfig moe = four_top_two();
  // 100 tokens a layer, 200 routed slots. Layer 0 balanced, layer 1 collapsed on expert 2
  // (95 of 100 tokens), layer 2 leaves expert 3 without a token (expected 50).
  const std::vector<std::vector<int64_t>> counts = {{50, 50, 50, 50}, {35, 40, 95, 30}, {70, 70, 60, 0}};
  const std::vector<Finding> found = router_collapse_findings(counts, 107, moe);
  REQUIRE(found.size() == 2);
  const nanreplay::Evidence& collapsed = found[0].evidence;
  CHECK(std::string(found[0].name()) == "NUMERIC_ROUTER_COLLAPSE");
  CHECK(found[0].severity == nanreplay::Severity::kWarning);
  CHECK(collapsed.integer(K::kStep) == 107);
  CHECK(collapsed.integer(K::kLayer) == 1);
  CHECK(collapsed.integer(K::kExpert) == 2);
  CHECK(collapsed.number(K::kShare).value_or(-1) == Approx(0.95));
  CHECK(collapsed.integer(K::kTokens) == 95);
  const nanreplay::Evidence& starved = found[1].evidence;
  CHECK(starved.integer(K::kLayer) == 2);
  CHECK(starved.integer(K::kExpert) == 3);
  CHECK(starved.number(K::kShare) == 0.0);
  CHECK(found[1].message.find("received no tokens") != std::string::npos);
  // A layer whose routing read NaN is not judged.
  CHECK(router_collapse_findings(counts, 107, moe, {1, 2}).empty());
}

TEST_CASE("what is not a collapse: at the point, few tokens, every expert chosen", "[moe][triage]") {
  const MoeConfig moe = four_top_two();
  CHECK(router_collapse_findings({{89, 45, 33, 33}}, 1, moe).empty());  // 89%: below 90%
  CHECK(router_collapse_findings({{77, 41, 41, 41}}, 1, moe).empty());  // an ordinary imbalance
  CHECK(router_collapse_findings({{4, 4, 4, 0}}, 1, moe).empty());      // 6 tokens: 3 expected, too few to judge
  CHECK(router_collapse_findings({{0, 0, 0, 0}}, 1, moe).empty());      // no tokens at all
  const MoeConfig dense_like{2, 2, 16, false, 0.0, 0.0};
  CHECK(router_collapse_findings({{10, 10}}, 1, dense_like).empty());  // top_k = num_experts: every expert, always
}

TEST_CASE("token counts per layer and expert come from the forward records of the first expert site", "[moe][triage]") {
  nanreplay::ModelConfig model;
  model.num_layers = 2;
  model.moe = four_top_two();
  std::vector<nanreplay::ProbeRecord> records;
  auto record = [&](int layer, int expert, int64_t routed, nanreplay::SiteId id, nanreplay::Phase phase, int64_t step) {
    nanreplay::ProbeRecord r;
    r.step = step;
    r.phase = phase;
    r.site = {id, layer};
    r.layer = layer;
    r.expert = expert;
    r.routed_tokens = routed;
    records.push_back(r);
  };
  using nanreplay::Phase;
  using nanreplay::SiteId;
  for (int micro = 0; micro < 2; ++micro) {  // two micro-batches add up
    record(1, 3, 7, SiteId::kMlpExpertGate, Phase::kForward, 5);
    record(1, -1, 40, SiteId::kMlpExpertGate, Phase::kForward, 5);  // the whole tensor: not an expert's
    record(1, 3, 99, SiteId::kMlpExpertUp, Phase::kForward, 5);     // later sites see the same tokens again
    record(1, 3, 99, SiteId::kMlpExpertGate, Phase::kBackward, 5);
    record(0, 1, 99, SiteId::kMlpExpertGate, Phase::kForward, 6);   // another step
  }
  const auto counts = expert_token_counts(records, 5, model);
  REQUIRE(counts.size() == 2);
  CHECK(counts[1] == std::vector<int64_t>{0, 0, 0, 14});
  CHECK(counts[0] == std::vector<int64_t>{0, 0, 0, 0});
  model.moe.reset();
  CHECK(expert_token_counts(records, 5, model).empty());
}

TEST_CASE("token counts have a row for each model.mtp block after the decoder's layers", "[moe][triage][mtp]") {
  nanreplay::ModelConfig model;
  model.num_layers = 2;
  model.moe = four_top_two();
  model.mtp = nanreplay::MultiTokenPrediction{1, 0.3};
  nanreplay::ProbeRecord r;
  r.step = 5;
  r.phase = nanreplay::Phase::kForward;
  r.site = {nanreplay::SiteId::kMlpExpertGate, 2};
  r.layer = 2;  // the MTP block's layer, num_layers + 1 - 1
  r.expert = 1;
  r.routed_tokens = 9;
  const auto counts = expert_token_counts({r}, 5, model);
  REQUIRE(counts.size() == 3);
  CHECK(counts[2] == std::vector<int64_t>{0, 9, 0, 0});
  CHECK(counts[0] == std::vector<int64_t>{0, 0, 0, 0});
}
