// See expert_outlier.h.
#include "reports/triage/numeric/expert_outlier.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "probes/robust_stats.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

using K = EvidenceKey;

bool per_expert_site(SiteId id) {
  return id == SiteId::kMlpExpertGate || id == SiteId::kMlpExpertUp || id == SiteId::kMlpExpertAct ||
         id == SiteId::kMlpExpertDown;
}

// One expert's output over the step: its largest finite |x| and the record (pass) holding it.
struct ExpertOutput {
  double max_abs = 0.0;
  const ProbeRecord* at = nullptr;
};

// [layer][expert] of the step's mlp.expert.down forward records (experts with routed rows only).
std::map<int, std::map<int, ExpertOutput>> expert_outputs(const std::vector<ProbeRecord>& records, int64_t step) {
  std::map<int, std::map<int, ExpertOutput>> out;
  for (const ProbeRecord& r : records) {
    if (r.step != step || r.phase != Phase::kForward || r.site.id != SiteId::kMlpExpertDown || r.expert < 0) continue;
    if (r.routed_tokens == 0) continue;
    ExpertOutput& e = out[r.layer][r.expert];
    if (e.at == nullptr || r.stats.max_abs > e.max_abs) e = {r.stats.max_abs, &r};
  }
  return out;
}

// The median of the other experts' output maxima of a layer; none with fewer than two others.
std::optional<double> typical_output(const std::map<int, ExpertOutput>& layer, int expert) {
  std::vector<double> others;
  for (const auto& [e, out] : layer) {
    if (e != expert && std::isfinite(out.max_abs)) others.push_back(out.max_abs);
  }
  if (others.size() < 2) return std::nullopt;
  return median_of(std::move(others));
}

int64_t token_of(const TokenAt& token_at, int64_t sample, int64_t position) {
  return token_at && sample >= 0 && position >= 0 ? token_at(sample, position) : -1;
}

std::string token_text(int64_t token, int64_t sample, int64_t position) {
  if (sample < 0) return "";
  return " on " + (token >= 0 ? "token " + std::to_string(token) + " at " : std::string()) + "sample " +
         std::to_string(sample) + " position " + std::to_string(position);
}

}  // namespace

std::vector<Finding> expert_outlier_findings(const std::vector<ProbeRecord>& records, int64_t step,
                                             const TriageThresholds& t, const TokenAt& token_at) {
  const std::map<int, std::map<int, ExpertOutput>> outputs = expert_outputs(records, step);
  // The incident's own expert: the earliest non-finite forward value at a per-expert site.
  const ProbeRecord* first = nullptr;
  for (const ProbeRecord& r : records) {
    if (r.step != step || r.phase != Phase::kForward || !is_whole(r) || !per_expert_site(r.site.id)) continue;
    if (r.stats.all_finite() || r.first_expert < 0) continue;
    if (first == nullptr || execution_key(r) < execution_key(*first)) first = &r;
  }
  if (first != nullptr) {
    const auto layer = outputs.find(first->layer);
    const std::optional<double> typical =
        layer == outputs.end() ? std::nullopt : typical_output(layer->second, first->first_expert);
    const int64_t token = token_of(token_at, first->sample, first->position);
    const char* value = nonfinite_kind_name(first->stats.first_kind);
    return {make_finding(FindingCode::kNumericExpertOutlierActivation, Severity::kError,
        "expert " + std::to_string(first->first_expert) + " of layer " + std::to_string(first->layer) +
            " went non-finite at " + probe_name(*first) + token_text(token, first->sample, first->position) +
            ", its layer's other experts' outputs staying finite" +
            (typical ? " (median max |x| " + format_number(*typical) + ")" : ""),
        {{K::kStep, step}, {K::kLayer, first->layer}, {K::kExpert, first->first_expert},
         {K::kSite, probe_name(*first)}, {K::kToken, optional_index_value(token)},
         {K::kSample, optional_index_value(first->sample)}, {K::kPosition, optional_index_value(first->position)},
         {K::kMicroBatch, first->micro_batch}, {K::kRank, first->rank}, {K::kValue, value},
         {K::kTypical, typical ? EvidenceValue(*typical) : EvidenceValue(nullptr)}})};
  }
  // A finite outlier: the largest ratio over the layers.
  std::optional<std::pair<double, std::pair<int, int>>> worst;  // (ratio, (layer, expert))
  double worst_typical = 0.0;
  for (const auto& [layer, experts] : outputs) {
    for (const auto& [expert, out] : experts) {
      if (!std::isfinite(out.max_abs) || out.max_abs <= t.expert_outlier_floor) continue;
      const std::optional<double> typical = typical_output(experts, expert);
      if (!typical) continue;
      const double ratio = *typical > 0 ? out.max_abs / *typical : INFINITY;
      if (ratio <= t.expert_outlier_ratio || (worst && ratio <= worst->first)) continue;
      worst = {ratio, {layer, expert}};
      worst_typical = *typical;
    }
  }
  if (!worst) return {};
  const auto [layer, expert] = worst->second;
  const ExpertOutput& out = outputs.at(layer).at(expert);
  const int64_t sample = out.at->largest_sample, position = out.at->largest_position;
  const int64_t token = token_of(token_at, sample, position);
  return {make_finding(FindingCode::kNumericExpertOutlierActivation, Severity::kWarning,
      "expert " + std::to_string(expert) + " of layer " + std::to_string(layer) + " output max |x| " +
          format_number(out.max_abs) + token_text(token, sample, position) + ", " + format_number(worst->first) +
          "x the median of its layer's other experts (" + format_number(worst_typical) + ")",
      {{K::kStep, step}, {K::kLayer, layer}, {K::kExpert, expert}, {K::kSite, probe_name(*out.at)},
       {K::kToken, optional_index_value(token)}, {K::kSample, optional_index_value(sample)},
       {K::kPosition, optional_index_value(position)}, {K::kMicroBatch, out.at->micro_batch},
       {K::kRank, out.at->rank}, {K::kValue, out.max_abs}, {K::kTypical, worst_typical}})};
}

}  // namespace nanreplay
