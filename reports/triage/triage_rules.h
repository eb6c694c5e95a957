// The triage rules that need no tensors: each turns probe records, norm
// checks, per-sample losses or logged values into findings for one layer of
// triage (data, numeric, system), and the rule that picks the most likely
// root cause from everything found. Thresholds are named once, here.
#pragma once

#include <optional>
#include <vector>

#include "loaders/bundle/step_state.h"
#include "probes/data_checks.h"
#include "probes/probe_record.h"
#include "reports/results/report.h"

namespace nanreplay {

struct TriageThresholds {
  double loss_rel_tol = 1e-4;        // replayed vs logged loss / grad norm
  // A derived (rolled-forward) step's loss vs the logged one: rounding
  // differences between two AdamW implementations compound step by step.
  double trajectory_rel_tol = 1e-3;
  double loss_outlier_z = 6.0;       // per-sample loss, robust z above the median
  double loss_outlier_nats = 1.0;    // ... and at least this far above it
  double fp8_scale_jump = 3.0;       // ratio between adjacent steps
  double headroom_warn_bits = 1.0;   // a finite site this close to its dtype max
  // A token's embedding row is an outlier at this many times the median row
  // norm and this robust z above it (docs/triage.md).
  double embedding_outlier_ratio = 10.0;
  double embedding_outlier_z = 10.0;
  DataCheckOptions data;
};

// Defaults for the bundle's precision: reduced precision compares looser.
TriageThresholds default_thresholds(Compute compute);


// First site of the step (execution order) holding an inf: where the value
// reached its type's limit. Also a near-miss warning when nothing overflowed.
std::vector<Finding> overflow_findings(const std::vector<ProbeRecord>& step_records, int64_t step,
                                       bool handled_by_scaler, Compute compute,
                                       const TriageThresholds& t);
std::vector<Finding> zero_norm_findings(const std::vector<NormCheck>& checks);
std::vector<Finding> fp8_scale_jump_findings(const std::vector<StepState>& states,
                                             const TriageThresholds& t);
// Whether every rank's logged gradient norm is the step's replayed global
// norm, where the ranks' own norms differ from it: the common convention of
// logging clip_grad_norm_'s result on each rank.
bool rank_norms_logged_global(const StepOutcome& step, const StepState& state, const TriageThresholds& thresholds);
std::vector<Finding> rank_mismatch_findings(const StepOutcome& step, const StepState& state,
                                            const TriageThresholds& t);
std::vector<Finding> sample_loss_findings(const std::vector<SampleLoss>& losses, int64_t step,
                                          const TriageThresholds& t);
// DATA_REPEAT_RUN and DATA_LOW_ENTROPY, judged against the stream's own
// samples; severity info until settle_verdict knows whether they are implicated.
std::vector<Finding> sample_profile_findings(const std::vector<SampleProfile>& profiles,
                                             const DataBaseline& baseline, int64_t step,
                                             int64_t seq_len, const DataCheckOptions& options);

// The non-finite records after `origin` in the same step, micro-batch and rank
// (then the step's parameter gradients), in execution order.
std::vector<PropagationEntry> propagation_after(const std::vector<ProbeRecord>& step_records,
                                                const ProbeRecord& origin, size_t limit = 500);

// data, then numeric, then system: the finding that best explains the run.
RootCause decide_root_cause(const ReplayReport& report);

// Findings ordered by triage layer (data, numeric, system), stable within.
void order_findings(std::vector<Finding>& findings);

}  // namespace nanreplay
