// See update_spike.h.
#include "reports/triage/numeric/update_spike.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>

#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

using K = EvidenceKey;

constexpr size_t kUpdateSpikesNamed = 3;
constexpr size_t kUpdateHistorySteps = 8;  // the recent steps a tensor's update is held against

// One tensor's update at one step that left its recent steps.
struct UpdateJump {
  int64_t step = 0;
  const TensorUpdateStats* stats = nullptr;
  std::optional<double> ratio;    // update RMS / median of the previous ones
  std::optional<double> typical;  // that median
  int64_t history = 0;            // previous steps the median is over
  double score = 0.0;             // what ranks the jumps: the larger of the ratio and sqrt(g^2 / v)
};

double median_update_rms(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The jump of `stats` against `previous` (its tensor's earlier update RMS values), or none.
std::optional<UpdateJump> update_jump_of(int64_t step, const TensorUpdateStats& stats, const std::vector<double>& previous,
                                  const TriageThresholds& t) {
  UpdateJump jump{step, &stats, std::nullopt, std::nullopt, 0, 0.0};
  bool jumped = false;
  if (previous.size() >= static_cast<size_t>(std::max(1, t.update_history)) && std::isfinite(stats.update_rms)) {
    const std::vector<double> recent(previous.end() - static_cast<std::ptrdiff_t>(std::min(previous.size(), kUpdateHistorySteps)),
                                     previous.end());
    const double typical = median_update_rms(recent);
    if (typical > 0) {
      jump.ratio = stats.update_rms / typical;
      jump.typical = typical;
      jump.history = static_cast<int64_t>(recent.size());
      jump.score = *jump.ratio;
      jumped = *jump.ratio >= t.update_jump_ratio;
    }
  }
  if (stats.g2_over_v && std::isfinite(*stats.g2_over_v)) {
    jump.score = std::max(jump.score, std::sqrt(*stats.g2_over_v));
    jumped = jumped || *stats.g2_over_v >= t.update_g2_over_v;
  }
  if (!jumped) return std::nullopt;
  return jump;
}

Finding update_spike_finding(const UpdateJump& j, int64_t incident_step) {
  const TensorUpdateStats& s = *j.stats;
  std::string message = s.param + ": the update from step " + std::to_string(j.step) + "'s gradients";
  if (j.ratio) {
    message += " has RMS " + format_number(s.update_rms) + ", " + format_number(*j.ratio) + "x the median of its " +
               std::to_string(j.history) + " step(s) before";
  } else {
    message += " has RMS " + format_number(s.update_rms);
  }
  if (s.g2_over_v) message += "; its g^2 is " + format_number(*s.g2_over_v) + "x the second moment its update divides by, on average";
  if (s.g2_over_v_max) message += ", " + format_number(*s.g2_over_v_max) + "x at most";
  message += j.step < incident_step ? " (before the incident at step " + std::to_string(incident_step) + ")"
                                    : " (the incident's step)";
  Evidence evidence{{K::kStep, j.step},
                    {K::kIncidentStep, incident_step},
                    {K::kParam, s.param},
                    {K::kUpdateRms, s.update_rms}};
  evidence.set(K::kTypical, j.typical ? EvidenceValue(*j.typical) : EvidenceValue());
  evidence.set(K::kUpdateRatio, j.ratio ? EvidenceValue(*j.ratio) : EvidenceValue());
  evidence.set(K::kG2OverV, s.g2_over_v ? EvidenceValue(*s.g2_over_v) : EvidenceValue());
  evidence.set(K::kG2OverVMax, s.g2_over_v_max ? EvidenceValue(*s.g2_over_v_max) : EvidenceValue());
  evidence.set(K::kG2OverVRms, s.g2_over_v_rms ? EvidenceValue(*s.g2_over_v_rms) : EvidenceValue());
  return make_finding(FindingCode::kNumericUpdateSpike, std::move(message), std::move(evidence));
}

}  // namespace

std::vector<Finding> update_spike_findings(const std::vector<StepUpdateStats>& updates, int64_t incident_step,
                                           const TriageThresholds& t) {
  std::map<std::string, std::vector<double>> previous;  // each tensor's update RMS so far
  for (const StepUpdateStats& step : updates) {
    if (step.step > incident_step) break;
    std::vector<UpdateJump> jumps;
    for (const TensorUpdateStats& stats : step.tensors) {
      if (stats.outside_optimizer) continue;  // SYSTEM_BIT_FLIP's or SYSTEM_UPDATE_MISMATCH's to name
      std::vector<double>& before = previous[stats.param];
      if (const std::optional<UpdateJump> jump = update_jump_of(step.step, stats, before, t)) jumps.push_back(*jump);
      if (std::isfinite(stats.update_rms)) before.push_back(stats.update_rms);
    }
    if (jumps.empty()) continue;
    std::stable_sort(jumps.begin(), jumps.end(), [](const UpdateJump& a, const UpdateJump& b) { return a.score > b.score; });
    std::vector<Finding> findings;
    for (size_t i = 0; i < jumps.size() && i < kUpdateSpikesNamed; ++i) {
      findings.push_back(update_spike_finding(jumps[i], incident_step));
    }
    return findings;
  }
  return {};
}

}  // namespace nanreplay
