// What the findings of a replay mean together, decided once every step has
// been replayed: whether the replay reproduces the run at all, which findings
// are only consequences of the first non-finite value, which data findings
// the failure implicates, which tokens of the origin are poisoned, and the
// most likely root cause. Plain data in and out (no tensors, no rendering).
#pragma once

#include "reports/triage/log_conventions.h"
#include "reports/results/report.h"
#include "reports/triage/triage_rules.h"

namespace nanreplay {

// Runs every stage below in order, then orders the findings and decides the root cause.
void settle_verdict(ReplayReport& report, const TriageThresholds& thresholds);

// The healthy steps against what the job logged: one odd step is a
// SYSTEM_NOT_REPRODUCIBLE warning; most or all of them off is
// BUNDLE_DOES_NOT_REPRODUCE (error). Also each step's logged loss and norm
// against the replay's by kind (NaN, inf, finite: logged_value.h). A log
// that follows another convention (log_conventions.h) is said once each
// (SYSTEM_LOG_CONVENTION, info) and compared as what it is on every step.
// Fills report.reproduction.
void judge_reproduction(ReplayReport& report, const TriageThresholds& thresholds);

// Rolling forward (called by judge_reproduction): the derived steps against
// the logged losses (as `convention` says they were logged) with the
// trajectory tolerance; the first beyond it is SYSTEM_TRAJECTORY_DIVERGED.
// Fills report.reproduction.trajectory.
void judge_trajectory(ReplayReport& report, const TriageThresholds& thresholds,
                      const LossConvention& convention = {});

// Findings that follow from the first non-finite value (later non-finite
// checkpoints, later non-finite steps, non-finite per-sample losses) become
// one info entry per kind covering the step range.
void fold_consequences(ReplayReport& report);

// DATA_REPEAT_RUN / DATA_LOW_ENTROPY are errors when the sample holds the
// origin or its own loss is an outlier, info otherwise.
void calibrate_data_findings(ReplayReport& report);

// DATA_TOKEN_EMBEDDING_OUTLIER for each outlier of report.origin_tokens.
void token_findings(ReplayReport& report);


}  // namespace nanreplay
