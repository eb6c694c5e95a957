// The verdict stages over a whole replay; see verdict.h. The thresholds are
// TriageThresholds' and docs/triage.md explains each rule.
#include "reports/triage/verdict.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "reports/triage/log_conventions.h"
#include "reports/results/logged_value.h"
#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

std::string step_range(int64_t first, int64_t last) {
  return first == last ? "step " + std::to_string(first) : "steps " + std::to_string(first) + "-" + std::to_string(last);
}

int64_t evidence_step(const Finding& f) { return f.evidence.integer(K::kStep).value_or(-1); }

// A logged value the replay contradicts in kind (compared as the log's
// convention says): NaN logged where the replay is finite (an error: suspect
// the machine), finite where the replay is not, or two non-finite kinds.
std::optional<Finding> contradicted(const StepOutcome& s, const char* tensor, double logged, double replayed) {
  if (value_kind(logged) == value_kind(replayed)) return std::nullopt;
  const Evidence evidence = {{K::kStep, s.step}, {K::kTensor, tensor}, {K::kExpected, replayed}, {K::kAfter, logged}};
  const std::string at = "step " + std::to_string(s.step) + ": ";
  const std::string what = std::string(tensor) == "loss" ? "loss " : "gradient norm ";
  if (!std::isfinite(logged) && std::isfinite(replayed)) {
    // A logged norm follows from every rank's gradients; a loss from its own forward alone.
    const bool certain = std::string(tensor) == "loss" || s.finite;
    return make_finding(FindingCode::kSystemNotReproducible, certain ? Severity::kError : Severity::kWarning,
                        at + "the job logged " + what + format_number(logged) + " but the deterministic replay "
                            "computes " + format_number(replayed) + (s.finite ? " with every value finite" : "") +
                            ": suspect the machine, not the model",
                        evidence);
  }
  if (std::isfinite(logged)) {
    return make_finding(FindingCode::kSystemNotReproducible, Severity::kWarning,
                        at + "the replay goes non-finite where the job logged " + what + format_number(logged),
                        evidence);
  }
  return make_finding(FindingCode::kSystemNotReproducible, Severity::kWarning,
                      at + "the job logged " + what + format_number(logged) + " where the replay computes " +
                          format_number(replayed) + ": both non-finite, of different kinds",
                      evidence);
}

std::vector<Finding> logged_nonfinite_findings(const StepOutcome& s, const LossConvention& convention) {
  std::vector<Finding> found;
  if (!s.replayed) return found;
  if (s.logged_loss) {
    if (auto f = contradicted(s, "loss", *s.logged_loss, replayed_as_logged(s, convention))) found.push_back(*f);
  }
  // A step the loss scaler skips is judged by its `skipped` flag, not its norm's kind.
  if (s.logged_grad_norm && !s.scaler_skipped) {
    if (auto f = contradicted(s, "grad_norm", *s.logged_grad_norm, s.grad_norm)) found.push_back(*f);
  }
  return found;
}

struct Gap {
  int64_t step;
  const char* tensor;  // "loss" or "grad_norm"
  double logged, replayed, relative;
};

Evidence gap_evidence(const Gap& g) {
  return {{K::kStep, g.step}, {K::kTensor, g.tensor}, {K::kExpected, g.logged}, {K::kAfter, g.replayed},
          {K::kRelative, g.relative}};
}

// What usually makes a bundle describe another run than the one it claims.
const std::vector<std::string>& typical_mismatches() {
  static const std::vector<std::string> causes = {
      "the sampler seed, epoch and epoch_start_step, or the recorded sample lists",
      "the rotary convention (rope_style): Meta, torchtitan and llama2.c checkpoints rotate adjacent pairs, "
      "Hugging Face rotates halves, and renaming the weights is not enough",
      "norm_eps", "rope_theta", "the MLP's activation (SwiGLU for llama, tanh-GELU for gpt2)",
      "the architecture options (tied embeddings, num_kv_heads, biases)"};
  return causes;
}

Finding does_not_reproduce(const ReplayReport& report, const std::vector<Gap>& gaps, int64_t off,
                           const ReproductionCheck& check) {
  const Gap& widest = *std::max_element(gaps.begin(), gaps.end(),
                                        [](const Gap& a, const Gap& b) { return a.relative < b.relative; });
  std::ostringstream text;
  text << off << " of " << check.checked_steps << " healthy step(s) miss what the job logged beyond the "
       << compute_name(report.precision) << " tolerance " << format_number(check.tolerance) << ", up to "
       << format_percent(widest.relative) << " (step " << widest.step << " " << widest.tensor << ": "
       << format_number(widest.replayed) << " replayed, " << format_number(widest.logged)
       << " logged): the bundle describes another model or data order than the run's. Check ";
  for (size_t i = 0; i < typical_mismatches().size(); ++i) text << (i ? "; " : "") << typical_mismatches()[i];
  std::vector<Evidence> listed;
  for (const Gap& g : gaps) listed.push_back(gap_evidence(g));
  const Gap& first = gaps.front();
  return make_finding(FindingCode::kBundleDoesNotReproduce, Severity::kError, text.str(),
                      {{K::kStep, first.step}, {K::kTensor, first.tensor}, {K::kExpected, first.logged},
                       {K::kAfter, first.replayed}, {K::kLength, off}, {K::kCheckedSteps, check.checked_steps},
                       {K::kTolerance, check.tolerance}, {K::kMaxRelativeGap, check.max_gap}, {K::kGaps, listed},
                       {K::kCauses, typical_mismatches()}});
}

Finding odd_step(const Gap& g) {
  const bool loss = std::string(g.tensor) == "loss";
  return make_finding(FindingCode::kSystemNotReproducible, Severity::kWarning,
                      "step " + std::to_string(g.step) + ": replayed " + (loss ? "loss " : "gradient norm ") +
                          format_number(g.replayed) + " is far from the logged " + format_number(g.logged) +
                          " (relative difference " + format_number(g.relative) + ")",
                      {{K::kStep, g.step}, {K::kTensor, g.tensor}, {K::kExpected, g.replayed}, {K::kAfter, g.logged}});
}

// ---- consequences ----------------------------------------------------------

// The steps a set of findings covers, and the finding that stands for them.
struct Fold {
  std::vector<size_t> members;  // indices into report.findings
  std::set<int64_t> steps;
  int64_t count = 0;            // tensors or samples
  std::vector<std::string> names;
};

std::vector<int64_t> steps_of(const Fold& fold) { return {fold.steps.begin(), fold.steps.end()}; }

// The first step at or after the origin, before `checkpoint_step`, whose
// update applied non-finite gradients (no loss scaler skipped it), or -1.
int64_t update_that_spread(const ReplayReport& report, int64_t origin, int64_t checkpoint_step) {
  for (const StepOutcome& s : report.steps) {
    if (s.replayed && s.step >= origin && s.step < checkpoint_step && !std::isfinite(s.grad_norm) &&
        !s.scaler_skipped) {
      return s.step;
    }
  }
  return -1;
}

// The latest replayed step before `before` whose checkpoint holds nothing non-finite.
std::optional<int64_t> last_clean_checkpoint(const ReplayReport& report, int64_t before) {
  std::set<int64_t> contaminated;
  for (const Finding& f : report.findings) {
    const std::vector<int64_t>* steps = f.evidence.integers(K::kSteps);
    if (f.code != FindingCode::kCheckpointNonfinite || steps == nullptr) continue;
    contaminated.insert(steps->begin(), steps->end());
  }
  std::optional<int64_t> clean;
  for (const StepOutcome& s : report.steps) {
    if (s.step < before && !contaminated.count(s.step)) clean = s.step;
  }
  return clean;
}

Finding checkpoint_consequence(const ReplayReport& report, const Fold& fold, int64_t update_step) {
  const int64_t first = *fold.steps.begin(), last = *fold.steps.rbegin();
  const std::optional<int64_t> clean = last_clean_checkpoint(report, first);
  bool params = false, moments = false;
  for (size_t i : fold.members) {
    const std::string kind = report.findings[i].evidence.text(K::kTensor).value_or("");
    (kind == "parameter" ? params : moments) = true;
  }
  const std::string kind_text = params && moments ? "parameters and optimizer moments"
                                : params          ? "parameters"
                                                  : "optimizer moments";
  return make_finding(FindingCode::kCheckpointNonfinite, Severity::kInfo,
      step_range(first, last) + ": " + std::to_string(fold.members.size()) + " tensor(s) of the checkpoints (" +
          kind_text + ") hold non-finite values because the update of step " + std::to_string(update_step) +
          " applied non-finite gradients: consequences of the first non-finite value, not causes" +
          (clean ? "; the last clean checkpoint is step " + std::to_string(*clean) + ", the one to resume from"
                 : ""),
      {{K::kStep, first}, {K::kLastStep, last}, {K::kSteps, steps_of(fold)}, {K::kLength, fold.members.size()},
       {K::kTensor, kind_text}, {K::kParams, fold.names},
       {K::kLastCleanStep, clean ? EvidenceValue(*clean) : EvidenceValue(nullptr)}, {K::kConsequence, true}});
}

Finding step_consequence(const ReplayReport& report, FindingCode code, const Fold& fold) {
  const Finding& sample = report.findings[fold.members.front()];
  const int64_t first = *fold.steps.begin(), last = *fold.steps.rbegin();
  const int64_t origin = report.first_nonfinite->step;
  return make_finding(code, Severity::kInfo,
                      step_range(first, last) + " go non-finite too (" + code_name(code) + " in " +
                          std::to_string(fold.steps.size()) + " step(s), first: " + sample.message +
                          "): they follow the first non-finite value at step " + std::to_string(origin),
                      {{K::kStep, first}, {K::kLastStep, last}, {K::kSteps, steps_of(fold)},
                       {K::kLength, fold.steps.size()}, {K::kSite, sample.evidence.text(K::kSite).value_or("")},
                       {K::kConsequence, true}});
}

Finding sample_loss_consequence(const ReplayReport& report, const Fold& fold) {
  const int64_t first = *fold.steps.begin(), last = *fold.steps.rbegin();
  const FirstNonfinite& origin = *report.first_nonfinite;
  std::vector<int64_t> samples;
  for (size_t i : fold.members) {
    for (int64_t s : *report.findings[i].evidence.integers(K::kSamples)) {
      if (samples.size() < 16) samples.push_back(s);
    }
  }
  return make_finding(FindingCode::kDataLossOutlier, Severity::kInfo,
                      step_range(first, last) + ": " + std::to_string(fold.count) +
                          " per-sample loss(es) are non-finite downstream of the first non-finite value (step " +
                          std::to_string(origin.step) + ", sample " + std::to_string(origin.sample) +
                          "): consequences, not properties of those samples",
                      {{K::kStep, first}, {K::kLastStep, last}, {K::kSteps, steps_of(fold)}, {K::kLength, fold.count},
                       {K::kSample, optional_index_value(origin.sample)}, {K::kSamples, samples}, {K::kConsequence, true}});
}

// Replaces each fold's members by the one finding that stands for them, at the first member's place.
void replace_folds(ReplayReport& report, const std::vector<std::pair<Fold, Finding>>& folds) {
  std::map<size_t, const Finding*> stand_in;
  std::set<size_t> dropped;
  for (const auto& [fold, finding] : folds) {
    if (fold.members.empty()) continue;
    stand_in[fold.members.front()] = &finding;
    dropped.insert(fold.members.begin(), fold.members.end());
  }
  std::vector<Finding> kept;
  for (size_t i = 0; i < report.findings.size(); ++i) {
    if (stand_in.count(i)) kept.push_back(*stand_in.at(i));
    else if (!dropped.count(i)) kept.push_back(std::move(report.findings[i]));
  }
  report.findings = std::move(kept);
}

// A data finding's sample is implicated by the failure: how, or null.
const char* implicated_by(const ReplayReport& report, const Finding& f) {
  const int64_t step = evidence_step(f), sample = f.evidence.integer(K::kSample).value_or(-1);
  const auto& first = report.first_nonfinite;
  if (first && first->step == step && first->sample == sample) return "origin";
  for (const Finding& other : report.findings) {
    const bool finite_outlier = other.code == FindingCode::kDataLossOutlier && !other.evidence.has(K::kSamples);
    if (finite_outlier && evidence_step(other) == step && other.evidence.integer(K::kSample) == sample) {
      return "loss";
    }
  }
  return nullptr;
}

// A replayed step's loss or gradient norm against the logged one (SYSTEM_TRAJECTORY_DIVERGED).
struct TrajectoryGap {
  int64_t step = 0;
  const char* tensor = "loss";  // "loss" or "grad_norm"
  double logged = 0.0, replayed = 0.0, relative = 0.0, tolerance = 0.0;
};

// The step's finite logged values against its replay (the loss as the log's convention says it was logged).
std::vector<TrajectoryGap> trajectory_gaps(const StepOutcome& s, const LossConvention& convention) {
  std::vector<TrajectoryGap> gaps;
  if (s.logged_loss && std::isfinite(*s.logged_loss) && std::isfinite(s.loss)) {
    const double replayed = replayed_as_logged(s, convention);
    if (std::isfinite(replayed)) gaps.push_back({s.step, "loss", *s.logged_loss, replayed, logged_gap(*s.logged_loss, replayed)});
  }
  if (s.logged_grad_norm && std::isfinite(*s.logged_grad_norm) && std::isfinite(s.grad_norm) && !s.scaler_skipped) {
    gaps.push_back({s.step, "grad_norm", *s.logged_grad_norm, s.grad_norm, logged_gap(*s.logged_grad_norm, s.grad_norm)});
  }
  return gaps;
}

Finding trajectory_finding(const TrajectoryGap& g, bool derived) {
  const std::string what = std::string(g.tensor) == "loss" ? "loss " : "gradient norm ";
  const std::string how = derived ? " (rolled forward from an earlier checkpoint)" : " (from its own checkpoint)";
  const std::string why =
      derived ? ": from here on the replay follows its own trajectory, not the run's. Causes: a fault in the run "
                "between the checkpoints (a flipped bit, a nondeterministic step), optimizer settings other than the "
                "manifest's, or rounding compounded over many steps; replay from a checkpoint nearer the failure"
              : ": the run left the replay here although it started from the same parameters. Causes: the machine "
                "computed something else (silent data corruption), a nondeterministic kernel, or a batch other than "
                "the bundle's";
  return make_finding(
      FindingCode::kSystemTrajectoryDiverged, Severity::kWarning,
      "step " + std::to_string(g.step) + how + " replays to " + what + format_number(g.replayed) +
          " where the job logged " + format_number(g.logged) + " (relative " + format_number(g.relative) +
          ", tolerance " + format_number(g.tolerance) + ")" + why,
      {{K::kStep, g.step}, {K::kExpected, g.logged}, {K::kAfter, g.replayed}, {K::kTensor, g.tensor},
       {K::kRelative, g.relative}, {K::kTolerance, g.tolerance}, {K::kReplayedFrom, derived ? "derived" : "checkpoint"}});
}

}  // namespace

void judge_reproduction(ReplayReport& report, const TriageThresholds& t) {
  ReproductionCheck& check = report.reproduction;
  check = ReproductionCheck{};
  check.tolerance = t.loss_rel_tol;
  const LossConvention convention = logged_loss_convention(report, t);
  const std::vector<Finding> conventions = log_convention_findings(report, convention);
  report.findings.insert(report.findings.end(), conventions.begin(), conventions.end());
  std::vector<Finding> found;
  std::vector<Gap> gaps;  // of the steps that miss
  for (const StepOutcome& s : report.steps) {
    for (Finding& f : logged_nonfinite_findings(s, convention)) found.push_back(std::move(f));
    if (!s.replayed || !s.logged_loss || !std::isfinite(*s.logged_loss) || !std::isfinite(s.loss)) continue;
    if (s.derived) continue;  // judge_trajectory's
    const double replayed_loss = replayed_as_logged(s, convention);
    if (!std::isfinite(replayed_loss)) continue;  // contradicted() said it
    ++check.checked_steps;
    std::vector<Gap> step_gaps;
    const double loss_gap = logged_gap(*s.logged_loss, replayed_loss);
    check.max_gap = std::max(check.max_gap, loss_gap);
    if (loss_gap > t.loss_rel_tol) step_gaps.push_back({s.step, "loss", *s.logged_loss, replayed_loss, loss_gap});
    if (s.logged_grad_norm && std::isfinite(*s.logged_grad_norm) && std::isfinite(s.grad_norm)) {
      const double norm_gap = logged_gap(*s.logged_grad_norm, s.grad_norm);
      check.max_gap = std::max(check.max_gap, norm_gap);
      if (norm_gap > t.loss_rel_tol) {
        step_gaps.push_back({s.step, "grad_norm", *s.logged_grad_norm, s.grad_norm, norm_gap});
      }
    }
    if (step_gaps.empty()) ++check.matching_steps;
    gaps.insert(gaps.end(), step_gaps.begin(), step_gaps.end());
  }
  const int64_t off = check.checked_steps - check.matching_steps;
  // One odd step among matching ones is that step's problem; more, or every
  // step, say the bundle describes another run.
  const bool whole_bundle = off >= 2 || (off >= 1 && off == check.checked_steps);
  if (check.checked_steps > 0) check.reproduces = !whole_bundle;
  if (whole_bundle) {
    found.push_back(does_not_reproduce(report, gaps, off, check));
  } else {
    for (const Gap& g : gaps) found.push_back(odd_step(g));
  }
  report.findings.insert(report.findings.end(), found.begin(), found.end());
  judge_trajectory(report, t, convention);
}

void judge_trajectory(ReplayReport& report, const TriageThresholds& t, const LossConvention& convention) {
  std::optional<ReproductionCheck::Trajectory>& trajectory = report.reproduction.trajectory;
  trajectory.reset();
  // A checkpoint step off the log is judged here only while the window as a
  // whole replays the run; otherwise BUNDLE_DOES_NOT_REPRODUCE says it all.
  const bool judge_checkpoints = report.reproduction.reproduces.value_or(true);
  std::optional<TrajectoryGap> first_checkpoint, first_derived;
  for (const StepOutcome& s : report.steps) {
    if (s.derived && !trajectory) trajectory = ReproductionCheck::Trajectory{0, t.trajectory_rel_tol, 0.0, std::nullopt};
    if (!s.replayed || (!s.derived && !judge_checkpoints)) continue;
    const double tolerance = s.derived ? t.trajectory_rel_tol : t.loss_rel_tol;
    std::optional<TrajectoryGap>& first = s.derived ? first_derived : first_checkpoint;
    for (TrajectoryGap gap : trajectory_gaps(s, convention)) {
      if (s.derived && std::string(gap.tensor) == "loss") {
        ++trajectory->checked_steps;
        trajectory->max_gap = std::max(trajectory->max_gap, gap.relative);
      }
      gap.tolerance = tolerance;
      if (gap.relative > tolerance && !first) first = gap;
    }
  }
  if (first_derived) trajectory->diverged_at = first_derived->step;
  if (first_checkpoint) report.findings.push_back(trajectory_finding(*first_checkpoint, false));
  if (first_derived) report.findings.push_back(trajectory_finding(*first_derived, true));
}

void fold_consequences(ReplayReport& report) {
  if (!report.first_nonfinite) return;
  const int64_t origin = report.first_nonfinite->step;
  Fold checkpoints, sample_losses;
  std::map<FindingCode, Fold> later_steps;
  int64_t spreading_update = -1;
  for (size_t i = 0; i < report.findings.size(); ++i) {
    const Finding& f = report.findings[i];
    const int64_t step = evidence_step(f);
    if (f.code == FindingCode::kCheckpointNonfinite && f.severity == Severity::kError && step > origin) {
      const int64_t update = update_that_spread(report, origin, step);
      if (update < 0) continue;  // no update explains it: a cause of its own
      spreading_update = spreading_update < 0 ? update : std::min(spreading_update, update);
      checkpoints.members.push_back(i);
      if (const std::vector<int64_t>* held = f.evidence.integers(K::kSteps)) {
        checkpoints.steps.insert(held->begin(), held->end());
      } else {
        checkpoints.steps.insert(step);
      }
      if (checkpoints.names.size() < 16) checkpoints.names.push_back(f.evidence.text(K::kParam).value_or(""));
    } else if (f.code == FindingCode::kDataLossOutlier && f.evidence.has(K::kSamples) && step >= origin) {
      sample_losses.members.push_back(i);
      sample_losses.steps.insert(step);
      sample_losses.count += f.evidence.integer(K::kLength).value_or(0);
    } else if ((f.code == FindingCode::kNumericOverflow || f.code == FindingCode::kNumericZeroNorm) && step > origin) {
      Fold& fold = later_steps[f.code];
      fold.members.push_back(i);
      fold.steps.insert(step);
    }
  }
  std::vector<std::pair<Fold, Finding>> folds;
  if (!checkpoints.members.empty()) {
    folds.emplace_back(checkpoints, checkpoint_consequence(report, checkpoints, spreading_update));
  }
  if (!sample_losses.members.empty()) folds.emplace_back(sample_losses, sample_loss_consequence(report, sample_losses));
  for (const auto& [code, fold] : later_steps) folds.emplace_back(fold, step_consequence(report, code, fold));
  replace_folds(report, folds);
}

void calibrate_data_findings(ReplayReport& report) {
  for (Finding& f : report.findings) {
    if (f.code != FindingCode::kDataRepeatRun && f.code != FindingCode::kDataLowEntropy) continue;
    const char* how = implicated_by(report, f);
    f.evidence.set(K::kImplicated, how ? EvidenceValue(how) : EvidenceValue(nullptr));
    if (how == nullptr) {
      f.severity = Severity::kInfo;
      f.message += "; nothing implicates it (text, code and tables hold such samples)";
    } else {
      f.severity = Severity::kError;
      f.message += std::string("; it ") +
                   (std::string(how) == "origin" ? "holds the first non-finite value" : "has an outlier loss");
    }
  }
}

void token_findings(ReplayReport& report) {
  if (!report.first_nonfinite) return;
  const FirstNonfinite& origin = *report.first_nonfinite;
  std::set<int64_t> named;
  for (const OriginToken& t : report.origin_tokens) {
    if (!t.outlier || !named.insert(t.token).second) continue;
    report.findings.push_back(make_finding(FindingCode::kDataTokenEmbeddingOutlier, Severity::kError,
        "token " + std::to_string(t.token) + " at position " + std::to_string(t.position) + " of sample " +
            std::to_string(origin.sample) + " has an embedding row of norm " + format_number(t.norm) + ", " +
            format_number(t.typical_norm > 0 ? t.norm / t.typical_norm : INFINITY) +
            "x the typical row (median " + format_number(t.typical_norm) + ")",
        {{K::kStep, origin.step}, {K::kToken, t.token}, {K::kSample, optional_index_value(origin.sample)},
         {K::kPosition, t.position}, {K::kNorm, t.norm}, {K::kTypicalNorm, t.typical_norm},
         {K::kAfter, t.norm}, {K::kExpected, t.typical_norm}}));
  }
}

namespace {

// With weights rewritten outside the optimizer as the root cause, the numeric
// overflow they make from that step on is its consequence: info, marked so.
void fold_into_rewrite(ReplayReport& report) {
  if (!report.root_cause || report.root_cause->code != FindingCode::kSystemUpdateMismatch) return;
  int64_t rewritten_at = -1;
  for (const Finding& f : report.findings) {
    if (f.code == FindingCode::kSystemUpdateMismatch && f.severity == Severity::kError) {
      rewritten_at = evidence_step(f);
      break;
    }
  }
  for (Finding& f : report.findings) {
    if (f.code != FindingCode::kNumericOverflow || evidence_step(f) < rewritten_at) continue;
    f.severity = Severity::kInfo;
    f.evidence.set(K::kConsequence, true);
    f.message = "consequence of the rewritten weights: " + f.message;
  }
}

}  // namespace

void settle_verdict(ReplayReport& report, const TriageThresholds& thresholds) {
  judge_reproduction(report, thresholds);
  fold_consequences(report);
  calibrate_data_findings(report);
  token_findings(report);
  for (Finding& f : report.findings) {
    // A jump landing on the failing step is an error: it is the likely cause.
    if (f.code == FindingCode::kNumericFp8ScaleJump && report.first_nonfinite &&
        evidence_step(f) == report.first_nonfinite->step) {
      f.severity = Severity::kError;
    }
  }
  order_findings(report.findings);
  report.root_cause = decide_root_cause(report);
  fold_into_rewrite(report);
}

}  // namespace nanreplay
