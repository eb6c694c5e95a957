// The counts and the exit status a BisectReport derives from its stages.
#include "reports/results/bisect_report.h"

#include <algorithm>

#include "loaders/base/error.h"

namespace nanreplay {

int64_t BisectReport::step_replays() const {
  int64_t sum = 0;
  for (const BisectStepTest& t : step_tests) sum += t.replays;
  return sum;
}

int64_t BisectReport::origin_replays() const { return step_replays() + site_replays; }

int64_t BisectReport::what_if_replays() const {
  int64_t sum = 0;
  if (what_if) {
    for (const WhatIfOutcome& w : *what_if) sum += w.replays;
  }
  return sum;
}

int64_t BisectReport::total_replays() const {
  return origin_replays() + samples.replays + what_if_replays() + check_replays + full_pass_replays;
}

bool BisectReport::any_not_replayed() const {
  return std::any_of(step_tests.begin(), step_tests.end(), [](const BisectStepTest& t) { return !t.replayed; });
}

int bisect_exit_status(const BisectReport& report) {
  const bool not_reproduced = !report.origin && !report.logged_nonfinite_steps.empty();
  const bool error_finding = std::any_of(report.findings.begin(), report.findings.end(),
                                         [](const Finding& f) { return f.severity == Severity::kError; });
  const bool spike_origin = report.spike && report.spike->origin;
  const bool found = report.origin || spike_origin || report.any_not_replayed() || not_reproduced || error_finding;
  return static_cast<int>(found ? ExitStatus::kFound : ExitStatus::kClean);
}

}  // namespace nanreplay
