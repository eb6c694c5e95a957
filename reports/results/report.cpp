// What a replay report derives from its own fields: root-cause codes, the
// probe summary, the steps worth listing, the exit status.
#include "reports/results/report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "loaders/base/error.h"

namespace nanreplay {

std::string root_cause_code(const RootCause& cause, bool reproduced) {
  if (cause.code) return code_name(*cause.code);
  return reproduced ? "NONFINITE" : "NONE";
}

std::string run_numbering_note(const FirstNonfinite& f, const std::string& otherwise) {
  if (f.original_sample) return " (run's sample " + std::to_string(*f.original_sample) + ")";
  if (f.original_offset) return " (run's token offset " + std::to_string(*f.original_offset) + ")";
  return otherwise;
}

nlohmann::json json_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return value;
}

nlohmann::json optional_index(int64_t value) {
  return value >= 0 ? nlohmann::json(value) : nlohmann::json(nullptr);
}


ProbeSummary summarize_probes(const std::vector<ProbeRecord>& step_records) {
  ProbeSummary summary;
  for (const ProbeRecord& r : step_records) {
    if (!is_whole(r) || r.phase == Phase::kGrad) continue;
    summary.probed = true;
    if (!r.stats.all_finite()) ++summary.nonfinite_records;
    if (!std::isfinite(r.stats.max_abs)) continue;
    double& largest = r.phase == Phase::kForward ? summary.forward_max_abs : summary.backward_max_abs;
    largest = std::max(largest, r.stats.max_abs);
  }
  return summary;
}

std::vector<size_t> steps_worth_listing(const ReplayReport& report) {
  const size_t n = report.steps.size();
  std::vector<size_t> rows;
  for (size_t i = 0; i < n; ++i) {
    const bool near_origin =
        report.first_nonfinite &&
        std::llabs(report.steps[i].step - report.first_nonfinite->step) <= static_cast<int64_t>(kListedEdge / 2);
    if (n <= kListedSteps || i < kListedEdge || i + kListedEdge >= n || near_origin) rows.push_back(i);
  }
  return rows;
}

FirstNonfinite first_nonfinite_of(const ProbeRecord& record) {
  FirstNonfinite first;
  first.step = record.step;
  first.phase = record.phase;
  first.site = record.site;
  first.param = record.param;
  first.layer = record.layer;
  first.head = record.first_head;
  first.expert = record.first_expert;
  first.kind = record.stats.first_kind;
  first.rank = record.rank;
  first.micro_batch = record.micro_batch;
  first.sample = record.sample;
  first.position = record.position;
  first.index = record.first_index;
  first.shape = record.shape;
  first.damage = record.damage;
  first.masked_score = record.masked_score;
  return first;
}


std::string determinism_scope(const DeterminismCheck& d) {
  const std::string step = "step " + std::to_string(d.step);
  if (d.whole_step) return step + " (every micro-batch)";
  return step + ", rank " + std::to_string(d.rank) + " micro-batch " + std::to_string(d.micro_batch);
}

int exit_status_for(const ReplayReport& report) {
  bool error_finding = false;
  for (const Finding& finding : report.findings) {
    error_finding = error_finding || finding.severity == Severity::kError;
  }
  const bool spike_named = report.spike && report.spike->origin.has_value();
  return static_cast<int>(report.reproduced || error_finding || spike_named ? ExitStatus::kFound
                                                                            : ExitStatus::kClean);
}

}  // namespace nanreplay
