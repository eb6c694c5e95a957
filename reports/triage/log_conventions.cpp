// Logging conventions recognised over a window; see log_conventions.h.
#include "reports/triage/log_conventions.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "reports/results/logged_value.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

// A step's logged loss is held to the trajectory tolerance when the step is derived.
double loss_tolerance(const StepOutcome& s, const TriageThresholds& t) {
  return s.derived ? t.trajectory_rel_tol : t.loss_rel_tol;
}

// Recognition reads the finite steps only: a non-finite step cannot tell the conventions apart.
bool finite_and_logged(const StepOutcome& s) {
  return s.replayed && s.logged_loss && std::isfinite(*s.logged_loss) && std::isfinite(s.loss);
}

// The candidates after the mean, in the order they are tried: each rank's own
// loss, then each rank's last micro-batch (what nanoGPT and llama2.c print).
// Only the last: every candidate more is one more chance that a bundle which
// does not reproduce matches by accident, at bf16's 1e-2 tolerance above all.
std::vector<LossConvention> candidates(const std::vector<const StepOutcome*>& steps) {
  size_t ranks = 0, micro_ranks = 0, micro_batches = 0;
  for (const StepOutcome* s : steps) {
    ranks = std::max(ranks, s->rank_losses.size());
    micro_ranks = std::max(micro_ranks, s->micro_batch_losses.size());
    for (const std::vector<double>& losses : s->micro_batch_losses) micro_batches = std::max(micro_batches, losses.size());
  }
  std::vector<LossConvention> out;
  // With one rank its loss is the mean; with one micro-batch it is the rank's.
  if (ranks >= 2) {
    for (size_t r = 0; r < ranks; ++r) out.push_back({static_cast<int>(r), std::nullopt});
  }
  if (micro_batches >= 2) {
    for (size_t r = 0; r < micro_ranks; ++r) out.push_back({static_cast<int>(r), static_cast<int>(micro_batches - 1)});
  }
  return out;
}

std::string loss_convention_text(const LossConvention& c, const ReplayReport& report) {
  const bool many_ranks = std::any_of(report.steps.begin(), report.steps.end(),
                                      [](const StepOutcome& s) { return s.rank_losses.size() >= 2; });
  const std::string rank = "rank " + std::to_string(*c.rank);
  if (!c.micro_batch) {
    return "the job logged " + rank + "'s own loss as the step's loss, not the mean over the ranks: the logged "
           "losses were compared with that rank's replayed loss; log the all-reduced loss so that a failure on "
           "another rank shows in the log (docs/capture.md)";
  }
  return "the job logged the loss of its last micro-batch (micro-batch " + std::to_string(*c.micro_batch) +
         (many_ranks ? " of " + rank : "") +
         ") as the step's loss, not the mean over the step's micro-batches" + (many_ranks ? " and ranks" : "") +
         ", as nanoGPT and llama2.c print it: the logged losses were compared with that "
         "micro-batch's replayed loss; log the mean over the micro-batches" + (many_ranks ? ", all-reduced," : "") +
         " so that a failure in another shows in the log (docs/capture.md)";
}

}  // namespace

double replayed_as_logged(const StepOutcome& s, const LossConvention& c) {
  if (!c.rank) return s.loss;
  const size_t r = static_cast<size_t>(*c.rank);
  if (!c.micro_batch) return r < s.rank_losses.size() ? s.rank_losses[r] : s.loss;
  const size_t m = static_cast<size_t>(*c.micro_batch);
  if (r < s.micro_batch_losses.size() && m < s.micro_batch_losses[r].size()) return s.micro_batch_losses[r][m];
  return s.loss;
}

LossConvention logged_loss_convention(const ReplayReport& report, const TriageThresholds& t) {
  std::vector<const StepOutcome*> finite, missed;
  for (const StepOutcome& s : report.steps) {
    if (!finite_and_logged(s)) continue;
    finite.push_back(&s);
    if (!logged_agrees(*s.logged_loss, s.loss, loss_tolerance(s, t))) missed.push_back(&s);
  }
  if (missed.empty()) return {};
  for (const LossConvention& c : candidates(finite)) {
    const bool explains = std::all_of(missed.begin(), missed.end(), [&](const StepOutcome* s) {
      return logged_agrees(*s->logged_loss, replayed_as_logged(*s, c), loss_tolerance(*s, t));
    });
    if (explains) return c;
  }
  return {};
}

std::vector<Finding> log_convention_findings(const ReplayReport& report, const LossConvention& loss) {
  std::vector<Finding> findings;
  std::vector<int64_t> global_norm_steps;
  for (const StepOutcome& s : report.steps) {
    if (s.rank_norms_logged_global) global_norm_steps.push_back(s.step);
  }
  if (!global_norm_steps.empty()) {
    findings.push_back(make_finding(
        FindingCode::kSystemLogConvention, Severity::kInfo,
        "the job logged the global gradient norm (what clip_grad_norm_ returns on every rank) as each rank's "
        "rank_grad_norms at " + std::to_string(global_norm_steps.size()) + " step(s): they were compared as the "
        "global norm, so they say nothing about single ranks; log each rank's norm before the all-reduce to "
        "check the ranks (docs/capture.md)",
        {{K::kTensor, "rank_grad_norms"}, {K::kSteps, global_norm_steps}, {K::kLength, global_norm_steps.size()}}));
  }
  if (loss.is_mean()) return findings;
  std::vector<int64_t> steps;  // every step compared so, finite or not
  for (const StepOutcome& s : report.steps) {
    if (s.replayed && s.logged_loss) steps.push_back(s.step);
  }
  Evidence evidence = {{K::kTensor, "loss"}, {K::kRank, *loss.rank}, {K::kSteps, steps}, {K::kLength, steps.size()}};
  if (loss.micro_batch) evidence.set(K::kMicroBatch, *loss.micro_batch);
  findings.push_back(make_finding(FindingCode::kSystemLogConvention, Severity::kInfo,
                                  loss_convention_text(loss, report), evidence));
  return findings;
}

}  // namespace nanreplay
