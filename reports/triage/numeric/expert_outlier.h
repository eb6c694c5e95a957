// NUMERIC_EXPERT_OUTLIER_ACTIVATION (docs/triage.md): one expert of a
// mixture of experts whose activation left its layer's other experts far
// behind, the way DeepSeek's and Kimi's reports describe a run's failures
// starting. From the per-expert probes of one step (mlp.expert.gate, .up,
// .act, .down), so it holds for a replay split over processes as the
// records do.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "probes/probe_record.h"
#include "reports/results/finding.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

// The input token id at (sample, position); -1 where unknown.
using TokenAt = std::function<int64_t(int64_t sample, int64_t position)>;

// At most one finding for `step`:
// - the step's earliest non-finite forward value at a per-expert site: that
//   expert, its token, sample and position (error: the incident's origin);
// - else the expert whose down projection's largest |x| (its output, before
//   the routing weight) is more than expert_outlier_ratio times the median of
//   its layer's other experts' and above expert_outlier_floor (warning; the
//   largest such ratio over the step's layers), with the sample and position
//   of that element where the replay located it (a spike incident);
// - else the expert whose output max is more than expert_outlier_ratio times
//   the median of its own maxima in `earlier_steps` (the window's replayed
//   steps before `step`, their steps[].expert_activation_max) and above the
//   floor: its layer's other experts grew with it (warning; evidence `steps`
//   names the steps compared with).
std::vector<Finding> expert_outlier_findings(const std::vector<ProbeRecord>& records, int64_t step,
                                             const TriageThresholds& t, const TokenAt& token_at,
                                             const std::vector<StepOutcome>& earlier_steps = {});

}  // namespace nanreplay
