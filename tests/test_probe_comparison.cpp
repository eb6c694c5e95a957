// Two replays of one step compared probe by probe (the determinism check and
// --cross-check): bit-for-bit equality, and findings that name the site as
// every other finding does, with its phase and head apart.
#include <catch2/catch.hpp>

#include <cmath>

#include "reports/triage/system/probe_comparison.h"

using namespace nanreplay;

namespace {

ProbeRecord record(Phase phase, const std::string& site, int head, double max_abs) {
  ProbeRecord r;
  r.step = 105;
  r.rank = 1;
  r.micro_batch = 0;
  r.phase = phase;
  r.site = parse_site_name(site).value();
  r.head = head;
  r.stats.count = 8;
  r.stats.finite_count = 8;
  r.stats.max_abs = max_abs;
  r.stats.sum = 1.5;
  return r;
}

std::vector<const ProbeRecord*> pointers(const std::vector<ProbeRecord>& records) {
  std::vector<const ProbeRecord*> out;
  for (const ProbeRecord& r : records) out.push_back(&r);
  return out;
}

}  // namespace

TEST_CASE("statistics are equal only when every bit is", "[replay][compare]") {
  TensorStats a;
  a.sum = 0.1 + 0.2;
  TensorStats b = a;
  CHECK(same_stats(a, b));
  b.sum = std::nextafter(a.sum, 1.0);
  CHECK_FALSE(same_stats(a, b));
  b = a;
  b.sum_sq = -0.0;  // equal as numbers, not as bits
  CHECK_FALSE(same_stats(a, b));
  a.sum = b.sum = std::nan("");
  b.sum_sq = a.sum_sq;
  CHECK(same_stats(a, b));  // the same NaN is the same result
  b.first_kind = NonfiniteKind::kPosInf;
  CHECK_FALSE(same_stats(a, b));
}

TEST_CASE("the first differing probe is named by its site, phase, rank, micro-batch and head", "[replay][compare]") {
  const std::vector<ProbeRecord> first{record(Phase::kForward, "layers.0.attn.scores", 0, 2.0),
                                       record(Phase::kForward, "layers.0.attn.scores", 1, 2.0),
                                       record(Phase::kBackward, "layers.1.attn.scores", 2, 3.0),
                                       record(Phase::kBackward, "layers.1.mlp.down", -1, 4.0)};
  std::vector<ProbeRecord> again = first;
  CHECK(compare_probes(pointers(first), again).difference.empty());
  CHECK(compare_probes(pointers(first), again).compared == 4);

  again[2].stats.max_abs = 3.0000001;
  again[3].stats.max_abs = 5.0;  // later differences do not matter: the first one is named
  const ProbeComparison cmp = compare_probes(pointers(first), again);
  CHECK(cmp.difference == "backward layers.1.attn.scores");
  REQUIRE(cmp.a == &first[2]);
  const nlohmann::json evidence = evidence_json(difference_evidence(105, cmp.where()));
  CHECK(evidence == nlohmann::json{{"step", 105}, {"phase", "backward"}, {"site", "layers.1.attn.scores"},
                                   {"rank", 1}, {"micro_batch", 0}, {"head", 2}, {"expert", nullptr}});

  const std::vector<ProbeRecord> whole_first{first[3]}, whole_again{again[3]};
  const ProbeComparison whole = compare_probes(pointers(whole_first), whole_again);
  CHECK(evidence_json(difference_evidence(105, whole.where()))["head"].is_null());

  // One expert of a mixture of experts' per-expert site.
  std::vector<ProbeRecord> expert_first{record(Phase::kForward, "layers.0.mlp.expert.up", -1, 1.0)};
  expert_first[0].expert = 3;
  std::vector<ProbeRecord> expert_again = expert_first;
  expert_again[0].stats.max_abs = 1.5;
  const ProbeComparison by_expert = compare_probes(pointers(expert_first), expert_again);
  CHECK(evidence_json(difference_evidence(105, by_expert.where()))["expert"] == 3);

  again.pop_back();
  const ProbeComparison shorter = compare_probes(pointers(first), again);
  CHECK(shorter.difference == "probe count 4 vs 3");
  CHECK(evidence_json(difference_evidence(105, shorter.where())) == nlohmann::json{{"step", 105}});
}
