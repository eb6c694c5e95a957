// The numeric layer of triage over plain data: where a step's values reached
// their type's limit (or nearly did), zero-norm denominators, fp8 scales that
// jump between steps, the overflow the fp16 loss scaler handles, and what the
// first non-finite value spread to. Thresholds: reports/results/triage_thresholds.h.
#pragma once

#include <cstdint>
#include <vector>

#include "loaders/bundle/step_state.h"
#include "probes/probe_record.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

// First site of the step (execution order) holding an inf: where the value
// reached its type's limit. Also a near-miss warning when nothing overflowed.
std::vector<Finding> overflow_findings(const std::vector<ProbeRecord>& step_records, int64_t step,
                                       bool handled_by_scaler, Compute compute,
                                       const TriageThresholds& t);
std::vector<Finding> zero_norm_findings(const std::vector<NormCheck>& checks);
std::vector<Finding> fp8_scale_jump_findings(const std::vector<StepState>& states,
                                             const TriageThresholds& t);
// NUMERIC_LOSS_SCALE_OVERFLOW (info): the backward overflowed at `bad` and the
// fp16 loss scaler skips the step and halves the scale.
Finding loss_scale_overflow_finding(const ProbeRecord& bad, const StepOutcome& outcome);

// The non-finite records after `origin` in the same step, micro-batch and rank
// (then the step's parameter gradients), in execution order.
std::vector<PropagationEntry> propagation_after(const std::vector<ProbeRecord>& step_records,
                                                const ProbeRecord& origin, size_t limit = 500);

}  // namespace nanreplay
