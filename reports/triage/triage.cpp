// Each stage's evidence through its layers' rules; see triage.h. The order
// findings are appended in is the order a report lists them within a layer.
#include "reports/triage/triage.h"

#include "reports/triage/data/data_findings.h"
#include "reports/triage/numeric/expert_load.h"
#include "reports/triage/numeric/expert_outlier.h"
#include "reports/triage/numeric/update_spike.h"
#include "reports/triage/loss_terms_note.h"
#include "reports/triage/mtp_note.h"
#include "reports/triage/provenance_note.h"
#include "reports/triage/spike_origin.h"
#include "reports/triage/system/site_mismatch.h"
#include "reports/triage/triage_rules.h"
#include "reports/triage/verdict.h"

namespace nanreplay {

namespace {

void append_findings(std::vector<Finding>& to, std::vector<Finding> more) {
  to.insert(to.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
}

}  // namespace

std::vector<Finding> triage_bundle(const BundleEvidence& e) {
  std::vector<Finding> findings = checksum_findings(e.checksum_mismatches);
  if (e.checkpoints != nullptr) append_findings(findings, checkpoint_nonfinite_findings(*e.checkpoints));
  return findings;
}

HostStepFindings triage_host_step(const HostStepEvidence& e) {
  HostStepFindings found;
  found.sampler = sampler_findings(e.bundle, e.entry);
  found.bad_tokens = batch_token_findings(e.bundle, e.entry.step, e.batch);
  if (found.bad_tokens.empty() && e.baseline != nullptr) {
    found.profile = batch_profile_findings(e.bundle, e.entry.step, e.batch, *e.baseline, e.data);
  }
  return found;
}

StepTriage triage_step(const StepEvidence& e, const TriageThresholds& t) {
  const StepOutcome& outcome = e.outcome;
  StepTriage triage;
  std::vector<Finding>& findings = triage.findings;
  if (e.handled_overflow_at != nullptr) findings.push_back(loss_scale_overflow_finding(*e.handled_overflow_at, outcome));
  append_findings(findings, overflow_findings(e.probes, outcome.step, outcome.handled_overflow, e.compute, t));
  append_findings(findings, zero_norm_findings(e.norm_checks));
  triage.expert_tokens = expert_token_counts(e.probes, outcome.step, e.model);
  if (e.model.moe) {
    append_findings(findings, router_collapse_findings(triage.expert_tokens, outcome.step, *e.model.moe,
                                                       layers_with_nonfinite_routing(e.probes, outcome.step)));
  }
  if (e.model.moe) {
    static const std::vector<StepOutcome> kNoEarlierSteps;
    const std::vector<StepOutcome>& earlier = e.earlier_steps ? *e.earlier_steps : kNoEarlierSteps;
    append_findings(findings, expert_outlier_findings(e.probes, outcome.step, t, e.token_at, earlier));
  }
  append_findings(findings, sample_loss_findings(e.sample_losses, outcome.step, t));
  triage.rank_norms_logged_global = rank_norms_logged_global(outcome, e.state, t);
  append_findings(findings, rank_mismatch_findings(outcome, e.state, t, triage.rank_norms_logged_global));
  append_findings(findings, scaler_skip_findings(outcome, e.state, e.compute));
  append_findings(findings, site_mismatch_findings(outcome.step, e.state, e.probes, e.model, e.compute));
  return triage;
}

std::vector<Finding> triage_update(const UpdateEvidence& e) {
  if (e.grads == nullptr) return derived_update_findings(e.bundle, e.current, e.next, e.params, e.lr);
  return update_findings(e.bundle, {&e.current, &e.next, &e.params, e.grads, e.lr, e.skipped_by_scaler});
}

RootCause root_cause_of(const std::optional<FirstNonfinite>& origin, std::vector<Finding> findings) {
  ReplayReport partial;
  partial.first_nonfinite = origin;
  partial.reproduced = origin.has_value();
  partial.findings = std::move(findings);
  order_findings(partial.findings);
  return decide_root_cause(partial);
}

std::vector<Finding> triage_window(const WindowEvidence& e, const TriageThresholds& t) {
  std::vector<Finding> findings = stray_token_findings(e.bundle, e.batch_samples);
  append_findings(findings, fp8_scale_jump_findings(e.states, t));
  if (e.updates != nullptr && e.incident_step) append_findings(findings, update_spike_findings(*e.updates, *e.incident_step, t));
  return findings;
}

std::vector<Finding> triage_recheck(const RecheckEvidence& e) {
  std::vector<Finding> findings;
  if (e.determinism != nullptr) findings = determinism_findings(e.step, *e.determinism);
  if (e.cross_check != nullptr) append_findings(findings, device_mismatch_findings(e.step, *e.cross_check));
  return findings;
}

void triage_verdict(ReplayReport& report, const TriageThresholds& thresholds, const Manifest& manifest) {
  settle_verdict(report, thresholds);
  name_spike_as_cause(report);
  note_defaulted_values(report);
  note_multi_token_prediction(report, manifest);
  note_loss_terms(report, manifest);
  annotate_original_samples(report, manifest);
}

std::vector<Finding> triage_reproduction(const std::vector<StepOutcome>& steps, Compute precision,
                                         const TriageThresholds& thresholds) {
  ReplayReport partial;
  partial.precision = precision;
  partial.steps = steps;
  judge_reproduction(partial, thresholds);
  return partial.findings;
}

}  // namespace nanreplay
