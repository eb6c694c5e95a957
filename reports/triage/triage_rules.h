// The triage rules by layer, each in its layer's folder (data/, numeric/,
// system/), with the thresholds they share (reports/results/triage_thresholds.h),
// and the rule that picks the most likely root cause from everything found.
// Workflows call reports/triage/triage.h instead: one call per stage.
#pragma once

#include <vector>

#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"
#include "reports/triage/data/data_rules.h"
#include "reports/triage/numeric/numeric_rules.h"
#include "reports/triage/system/system_rules.h"

namespace nanreplay {

// data, then numeric, then system: the finding that best explains the run.
RootCause decide_root_cause(const ReplayReport& report);

// Findings ordered by triage layer (data, numeric, system), stable within.
void order_findings(std::vector<Finding>& findings);

}  // namespace nanreplay
