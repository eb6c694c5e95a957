// The ways a job logs its numbers other than the bundle format asks, each
// recognised over the replayed window and then held on every step of it,
// finite or not: the loss as one rank's own (rank 0 printing its local loss)
// or as one micro-batch's (nanoGPT and llama2.c print the last micro-batch's)
// instead of the mean over micro-batches and ranks; the global gradient norm
// (clip_grad_norm_'s) as every rank's own (rank_norms_logged_global in
// system/system_rules.h). Recognised conventions are said once each as
// SYSTEM_LOG_CONVENTION (info); docs/triage.md lists them.
#pragma once

#include <optional>
#include <vector>

#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

// What the logged loss of a step is: the mean over ranks and micro-batches
// (no rank), one rank's own loss (rank), or one micro-batch's loss on one
// rank (rank and micro_batch: the last one is the only one recognised).
struct LossConvention {
  std::optional<int> rank;
  std::optional<int> micro_batch;
  bool is_mean() const { return !rank; }
};

// The mean, unless a finite step misses it and one rank's loss, or else one
// rank's last micro-batch's, matches every finite step that misses: then
// that one, the lowest rank first.
LossConvention logged_loss_convention(const ReplayReport& report, const TriageThresholds& thresholds);

// The replayed number a step's logged loss is compared with under `convention`
// (the mean where the step lacks the rank or micro-batch).
double replayed_as_logged(const StepOutcome& step, const LossConvention& convention);

// SYSTEM_LOG_CONVENTION (info), once per convention the log follows, naming its steps.
std::vector<Finding> log_convention_findings(const ReplayReport& report, const LossConvention& loss);

}  // namespace nanreplay
