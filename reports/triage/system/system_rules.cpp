// The system layer's rules over plain data; see system_rules.h.
#include "reports/triage/system/system_rules.h"

#include "reports/results/logged_value.h"
#include "reports/results/number_text.h"
#include "reports/triage/system/probe_comparison.h"

namespace nanreplay {

using K = EvidenceKey;

bool rank_norms_logged_global(const StepOutcome& s, const StepState& state, const TriageThresholds& t) {
  const std::vector<double>& logged = state.logged.rank_grad_norms;
  if (!s.replayed || s.rank_grad_norms.size() < 2 || logged.size() != s.rank_grad_norms.size()) return false;
  // By kind too: at the step that went NaN the all-reduce spreads one rank's
  // NaN into every rank's clip_grad_norm_, and that is still the convention.
  bool own_differs = false;
  for (size_t r = 0; r < logged.size(); ++r) {
    if (!logged_agrees(logged[r], s.grad_norm, t.loss_rel_tol)) return false;
    own_differs = own_differs || !logged_agrees(logged[r], s.rank_grad_norms[r], t.loss_rel_tol);
  }
  return own_differs;
}

std::vector<Finding> rank_mismatch_findings(const StepOutcome& s, const StepState& state,
                                            const TriageThresholds& t) {
  return rank_mismatch_findings(s, state, t, s.rank_norms_logged_global);
}

std::vector<Finding> rank_mismatch_findings(const StepOutcome& s, const StepState& state,
                                            const TriageThresholds& t, bool norms_logged_global) {
  std::vector<Finding> findings;
  // With one rank the per-rank values are the step's own: reproducibility covers them.
  if (!s.replayed || s.rank_losses.size() < 2) return findings;
  auto compare = [&](const char* what, const std::vector<double>& replayed, const std::vector<double>& logged) {
    if (logged.size() != replayed.size()) return;
    for (size_t r = 0; r < logged.size(); ++r) {
      const double ours = replayed[r], theirs = logged[r];
      if (logged_agrees(theirs, ours, t.loss_rel_tol)) continue;
      findings.push_back(make_finding(FindingCode::kSystemRankMismatch, Severity::kError,
          "step " + std::to_string(s.step) + ": rank " + std::to_string(r) + " logged " + what + " " +
              format_number(theirs) + " but replaying its share gives " + format_number(ours),
          {{K::kStep, s.step}, {K::kRank, r}, {K::kTensor, what}, {K::kExpected, (ours)},
           {K::kAfter, (theirs)}}));
    }
  };
  compare("loss", s.rank_losses, state.logged.rank_losses);
  if (!norms_logged_global) compare("grad_norm", s.rank_grad_norms, state.logged.rank_grad_norms);
  return findings;
}

std::vector<Finding> scaler_skip_findings(const StepOutcome& s, const StepState& state, Compute compute) {
  if (!state.skipped || compute != Compute::kFp16 || *state.skipped == s.scaler_skipped) return {};
  return {make_finding(FindingCode::kSystemNotReproducible,
                       "step " + std::to_string(s.step) + ": the job logged skipped=" +
                           (*state.skipped ? "true" : "false") + " but the replay's gradients say the scaler " +
                           (s.scaler_skipped ? "skips" : "does not skip") + " it",
                       {{K::kStep, s.step}, {K::kExpected, s.scaler_skipped}, {K::kAfter, *state.skipped}})};
}

std::vector<Finding> checksum_findings(const std::vector<ChecksumMismatch>& mismatches) {
  std::vector<Finding> findings;
  for (const ChecksumMismatch& bad : mismatches) {
    findings.push_back(make_finding(FindingCode::kBundleChecksumMismatch,
                                    bad.shard + ": sha256 is " + bad.actual + ", the manifest says " + bad.expected,
                                    {{K::kShard, bad.shard}, {K::kExpected, bad.expected}, {K::kAfter, bad.actual}}));
  }
  return findings;
}

std::vector<Finding> determinism_findings(int64_t step, const DeterminismCheck& check) {
  if (check.identical) return {};
  return {make_finding(FindingCode::kSystemNondeterministic,
                       "replaying " + determinism_scope(check) + " twice on this machine gave different values at " +
                           check.first_difference,
                       difference_evidence(step, check.where))};
}

std::vector<Finding> device_mismatch_findings(int64_t step, const CrossDeviceCheck& c) {
  if (c.identical) return {};
  return {make_finding(FindingCode::kSystemDeviceMismatch,
                       "step " + std::to_string(step) + " replayed on " + c.device_a + " and " + c.device_b +
                           " from the same inputs differs first at " + c.first_difference + " (rank " +
                           std::to_string(c.where.rank) + ", micro-batch " + std::to_string(c.where.micro_batch) +
                           "): one of the two devices computes wrongly",
                       difference_evidence(step, c.where).set(K::kBefore, c.max_abs_a).set(K::kAfter, c.max_abs_b))};
}

}  // namespace nanreplay
