// NUMERIC_UPDATE_SPIKE: the spike mechanism an optimizer makes visible. Up to
// the incident step, each tensor's update RMS against the median of its own
// previous steps, and for Adam and Adafactor the new squared gradient against the second
// moment the update divides by (a second moment that lags far behind a sudden
// gradient lets the update jump); the tensors whose update jumped first are
// named. Context, not a root cause (docs/triage.md).
#pragma once

#include <cstdint>
#include <vector>

#include "reports/results/finding.h"
#include "reports/results/triage_thresholds.h"
#include "reports/results/update_stats.h"

namespace nanreplay {

// `updates` in step order; only those of steps <= incident_step are read.
// At most three findings, all of the earliest step any tensor jumped at,
// largest jump first.
std::vector<Finding> update_spike_findings(const std::vector<StepUpdateStats>& updates, int64_t incident_step,
                                           const TriageThresholds& t);

}  // namespace nanreplay
