#include "reports/triage/numeric/expert_load.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "probes/sites.h"
#include "reports/results/number_text.h"

namespace nanreplay {

std::vector<std::vector<int64_t>> expert_token_counts(const std::vector<ProbeRecord>& records, int64_t step,
                                                      const ModelConfig& model) {
  if (!model.moe) return {};
  std::vector<std::vector<int64_t>> counts;
  for (const ProbeRecord& r : records) {
    // The first per-expert site of a layer sees every routed token once.
    if (r.step != step || r.phase != Phase::kForward || r.site.id != SiteId::kMlpExpertGate || r.expert < 0) continue;
    // A row per layer with sites: model.mtp's blocks after the decoder's, as their sites name them.
    if (counts.empty()) {
      counts.assign(static_cast<size_t>(layers_with_sites(model)),
                    std::vector<int64_t>(static_cast<size_t>(model.moe->num_experts), 0));
    }
    counts.at(static_cast<size_t>(r.layer)).at(static_cast<size_t>(r.expert)) += r.routed_tokens;
  }
  return counts;
}

double collapsed_share(int64_t top_k, int64_t num_experts) {
  const double balanced = static_cast<double>(top_k) / static_cast<double>(num_experts);
  return std::min(kCollapsedOverBalanced * balanced, balanced + kCollapsedOfTheRest * (1.0 - balanced));
}

const StepOutcome* expert_load_step(const ReplayReport& report) {
  std::optional<int64_t> collapse_step;
  for (const Finding& f : report.findings) {
    if (f.code == FindingCode::kNumericRouterCollapse && !collapse_step) collapse_step = f.evidence.integer(EvidenceKey::kStep);
  }
  const StepOutcome* last = nullptr;
  const StepOutcome* collapsed = nullptr;
  for (const StepOutcome& step : report.steps) {
    if (step.expert_tokens.empty()) continue;
    if (report.first_nonfinite && report.first_nonfinite->step == step.step) return &step;
    if (collapse_step && *collapse_step == step.step) collapsed = &step;
    last = &step;
  }
  return collapsed != nullptr ? collapsed : last;
}

double expert_share(const std::vector<int64_t>& layer_counts, int64_t expert, int64_t top_k) {
  const int64_t slots = std::accumulate(layer_counts.begin(), layer_counts.end(), int64_t{0});
  if (slots <= 0) return 0.0;
  return static_cast<double>(layer_counts.at(static_cast<size_t>(expert))) * static_cast<double>(top_k) /
         static_cast<double>(slots);
}

std::set<int> layers_with_nonfinite_routing(const std::vector<ProbeRecord>& records, int64_t step) {
  std::set<int> layers;
  for (const ProbeRecord& r : records) {
    if (r.step == step && r.phase == Phase::kForward && r.site.id == SiteId::kMlpRouterProbs && !r.stats.all_finite()) {
      layers.insert(r.layer);
    }
  }
  return layers;
}

std::vector<Finding> router_collapse_findings(const std::vector<std::vector<int64_t>>& counts, int64_t step,
                                              const MoeConfig& moe, const std::set<int>& unjudged) {
  using K = EvidenceKey;
  std::vector<Finding> findings;
  if (moe.top_k >= moe.num_experts) return findings;  // every token reaches every expert
  for (size_t layer = 0; layer < counts.size(); ++layer) {
    if (unjudged.count(static_cast<int>(layer)) != 0) continue;
    const std::vector<int64_t>& row = counts[layer];
    // Each token picks top_k distinct experts: the layer's tokens are its routed slots / top_k.
    const double tokens = static_cast<double>(std::accumulate(row.begin(), row.end(), int64_t{0})) /
                          static_cast<double>(moe.top_k);
    if (tokens <= 0) continue;
    const auto busiest = std::max_element(row.begin(), row.end());
    const double share = static_cast<double>(*busiest) / tokens;
    const int busiest_expert = static_cast<int>(busiest - row.begin());
    const std::string where = "step " + std::to_string(step) + ", layer " + std::to_string(layer);
    if (share > collapsed_share(moe.top_k, moe.num_experts)) {
      findings.push_back(make_finding(
          FindingCode::kNumericRouterCollapse,
          where + ": the router sent " + format_number(100 * share) + "% of the tokens to expert " +
              std::to_string(busiest_expert) + " (balanced: " +
              format_number(100.0 * static_cast<double>(moe.top_k) / static_cast<double>(moe.num_experts)) + "%)",
          {{K::kStep, step}, {K::kLayer, static_cast<int64_t>(layer)}, {K::kExpert, busiest_expert},
           {K::kShare, share}, {K::kTokens, *busiest}}));
      continue;
    }
    const double expected = tokens * static_cast<double>(moe.top_k) / static_cast<double>(moe.num_experts);
    const auto idle = std::find(row.begin(), row.end(), 0);
    if (idle != row.end() && expected >= kStarvedExpectedTokens) {
      const int expert = static_cast<int>(idle - row.begin());
      findings.push_back(make_finding(
          FindingCode::kNumericRouterCollapse,
          where + ": expert " + std::to_string(expert) + " received no tokens (balanced: " + format_number(expected) +
              " of " + format_number(tokens) + ")",
          {{K::kStep, step}, {K::kLayer, static_cast<int64_t>(layer)}, {K::kExpert, expert}, {K::kShare, 0.0},
           {K::kTokens, int64_t{0}}}));
    }
  }
  return findings;
}

}  // namespace nanreplay
