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

// A finite expert output past the ratio and the floor: against what, and by how much.
struct Outlier {
  int layer = 0;
  int expert = 0;
  double ratio = 0.0;
  double typical = 0.0;
  std::vector<int64_t> history;  // the earlier steps compared with; empty: the layer's other experts
};

bool beats(const std::optional<Outlier>& best, double ratio) { return !best || ratio > best->ratio; }

// An output past the floor and `ratio` times `typical`: its ratio; none otherwise.
std::optional<double> outlier_ratio(double max_abs, double typical, const TriageThresholds& t) {
  if (!std::isfinite(max_abs) || max_abs <= t.expert_outlier_floor) return std::nullopt;
  const double ratio = typical > 0 ? max_abs / typical : INFINITY;
  if (ratio <= t.expert_outlier_ratio) return std::nullopt;
  return ratio;
}

// The largest ratio over the layers of an expert's output to its layer's other experts' median.
std::optional<Outlier> layer_outlier(const std::map<int, std::map<int, ExpertOutput>>& outputs,
                                     const TriageThresholds& t) {
  std::optional<Outlier> worst;
  for (const auto& [layer, experts] : outputs) {
    for (const auto& [expert, out] : experts) {
      const std::optional<double> typical = typical_output(experts, expert);
      const std::optional<double> ratio = typical ? outlier_ratio(out.max_abs, *typical, t) : std::nullopt;
      if (ratio && beats(worst, *ratio)) worst = Outlier{layer, expert, *ratio, *typical, {}};
    }
  }
  return worst;
}

// The largest ratio of an expert's output to the median of its own output maxima in the window's earlier
// steps that routed tokens to it (at least t.expert_history of them): a layer whose experts all grew
// together leaves no expert far from the others, yet each far from its own past.
std::optional<Outlier> history_outlier(const std::map<int, std::map<int, ExpertOutput>>& outputs,
                                       const std::vector<StepOutcome>& earlier_steps, const TriageThresholds& t) {
  std::optional<Outlier> worst;
  for (const auto& [layer, experts] : outputs) {
    for (const auto& [expert, out] : experts) {
      std::vector<double> past;
      std::vector<int64_t> steps;
      for (const StepOutcome& earlier : earlier_steps) {
        const size_t l = static_cast<size_t>(layer);
        if (l >= earlier.expert_activation_max.size() || !earlier.expert_activation_max[l]) continue;
        const std::vector<ExpertActivationMax>& maxima = *earlier.expert_activation_max[l];
        if (static_cast<size_t>(expert) >= maxima.size()) continue;
        const ExpertActivationMax& m = maxima[static_cast<size_t>(expert)];
        if (m.rows == 0 || !std::isfinite(m.output)) continue;
        past.push_back(m.output);
        steps.push_back(earlier.step);
      }
      if (static_cast<int>(past.size()) < t.expert_history) continue;
      const double typical = median_of(std::move(past));
      const std::optional<double> ratio = outlier_ratio(out.max_abs, typical, t);
      if (ratio && beats(worst, *ratio)) worst = Outlier{layer, expert, *ratio, typical, steps};
    }
  }
  return worst;
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
                                             const TriageThresholds& t, const TokenAt& token_at,
                                             const std::vector<StepOutcome>& earlier_steps) {
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
  const std::optional<Outlier> outlier = layer_outlier(outputs, t);
  const std::optional<Outlier> found = outlier ? outlier : history_outlier(outputs, earlier_steps, t);
  if (!found) return {};
  const ExpertOutput& out = outputs.at(found->layer).at(found->expert);
  const int64_t sample = out.at->largest_sample, position = out.at->largest_position;
  const int64_t token = token_of(token_at, sample, position);
  const std::string against = found->history.empty()
      ? "the median of its layer's other experts"
      : "its own median over steps " + std::to_string(found->history.front()) + ".." +
            std::to_string(found->history.back()) + ", its layer's other experts having moved with it";
  Evidence evidence = {{K::kStep, step}, {K::kLayer, found->layer}, {K::kExpert, found->expert},
                       {K::kSite, probe_name(*out.at)}, {K::kToken, optional_index_value(token)},
                       {K::kSample, optional_index_value(sample)}, {K::kPosition, optional_index_value(position)},
                       {K::kMicroBatch, out.at->micro_batch}, {K::kRank, out.at->rank}, {K::kValue, out.max_abs},
                       {K::kTypical, found->typical}};
  if (!found->history.empty()) evidence.set(K::kSteps, found->history);
  return {make_finding(FindingCode::kNumericExpertOutlierActivation, Severity::kWarning,
      "expert " + std::to_string(found->expert) + " of layer " + std::to_string(found->layer) + " output max |x| " +
          format_number(out.max_abs) + token_text(token, sample, position) + ", " + format_number(found->ratio) +
          "x " + against + " (" + format_number(found->typical) + ")",
      std::move(evidence))};
}

}  // namespace nanreplay
