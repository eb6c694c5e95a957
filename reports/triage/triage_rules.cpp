// The root-cause choice over every layer's findings; see triage_rules.h.
#include "reports/triage/triage_rules.h"

#include <algorithm>
#include <string>

#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

// One rule of the root-cause choice: the first finding it accepts, and the
// sentence a person reads. Rules are tried in table order (docs/triage.md).
struct RootCauseRule {
  FindingCode code;
  enum class When { kAlways, kWithOrigin, kWithoutOrigin } when;
  bool (*accepts)(const Finding& f, const ReplayReport& report);
  std::string (*summary)(const Finding& f, const ReplayReport& report);
};

bool is_error(const Finding& f, const ReplayReport&) { return f.severity == Severity::kError; }
bool any(const Finding&, const ReplayReport&) { return true; }
bool at_origin_step(const Finding& f, const ReplayReport& r) {
  return f.evidence.integer(K::kStep) == r.first_nonfinite->step;
}
std::string origin_site(const ReplayReport& r) { return r.first_nonfinite->name(); }
std::string poisoned_sample_summary(const Finding& f, const ReplayReport& r) {
  return "poisoned sample " + std::to_string(r.first_nonfinite->sample) + " (" + f.message +
         ") drives the first non-finite value at " + r.first_nonfinite->name();
}

// Tensors rewritten outside the optimizer (SYSTEM_UPDATE_MISMATCH errors) into
// the checkpoint of `f`'s step, each with its magnitudes; what they cause follows.
std::string rewritten_summary(const Finding& f, const ReplayReport& r) {
  const int64_t step = f.evidence.integer(K::kStep).value_or(-1);
  std::string tensors;
  for (const Finding& g : r.findings) {
    if (g.code != f.code || g.severity != Severity::kError || g.evidence.integer(K::kStep) != step) continue;
    tensors += (tensors.empty() ? "" : ", ") + g.evidence.text(K::kParam).value_or("?") + " (||found|| / ||expected|| " +
               format_number(g.evidence.number(K::kNormRatio).value_or(0.0)) + ", max |expected - found| " +
               format_number(g.evidence.number(K::kMaxAbsDiff).value_or(0.0)) + ")";
  }
  std::string text = "the checkpoint of step " + std::to_string(step) +
                     " holds weights rewritten outside the optimizer: " + tensors;
  if (r.first_nonfinite) {
    text += "; the non-finite value first produced at " + origin_site(r) + " (step " +
            std::to_string(r.first_nonfinite->step) + ") is its consequence";
  }
  return text;
}

const std::vector<RootCauseRule>& root_cause_rules() {
  using C = FindingCode;
  using W = RootCauseRule::When;
  static const std::vector<RootCauseRule> rules = {
      {C::kBundleChecksumMismatch, W::kAlways, any,
       [](const Finding& f, const ReplayReport&) { return "the bundle's data differs from what the job read (" + f.message + ")"; }},
      // Nothing else holds when the replay does not replay the run.
      {C::kBundleDoesNotReproduce, W::kAlways, any,
       [](const Finding& f, const ReplayReport&) {
         return "the bundle does not describe the run: " + std::to_string(f.evidence.integer(K::kLength).value_or(0)) +
                " of " + std::to_string(f.evidence.integer(K::kCheckedSteps).value_or(0)) +
                " healthy step(s) miss what the job logged, so no verdict about the failure holds until the bundle "
                "matches the job (see the finding for what to check)";
       }},
      {C::kSystemBitFlip, W::kAlways, any,
       [](const Finding& f, const ReplayReport&) {
         return "hardware: a single flipped bit in " + f.evidence.text(K::kParam).value_or("a weight") + " (bit " +
                std::to_string(f.evidence.integer(K::kBit).value_or(-1)) + ", first held by the checkpoint of step " +
                std::to_string(f.evidence.integer(K::kStep).value_or(-1)) +
                "): silent data corruption, not the model or the data";
       }},
      // A tensor rewritten outside the optimizer, at or before the failure, outranks the overflow it causes.
      {C::kSystemUpdateMismatch, W::kAlways,
       [](const Finding& f, const ReplayReport& r) {
         return is_error(f, r) && (!r.first_nonfinite || f.evidence.integer(K::kStep).value_or(0) <= r.first_nonfinite->step);
       },
       rewritten_summary},
      // The machine computed something else than the replay at a site, at or before the failure.
      {C::kSystemSiteMismatch, W::kAlways,
       [](const Finding& f, const ReplayReport& r) {
         return !r.first_nonfinite || f.evidence.integer(K::kStep).value_or(0) <= r.first_nonfinite->step;
       },
       [](const Finding& f, const ReplayReport&) {
         return "the training machine computed something else than the replay: " + f.message;
       }},
      {C::kCheckpointNonfinite, W::kAlways, is_error,
       [](const Finding& f, const ReplayReport&) {
         return "the checkpoint itself already holds non-finite values (" + f.message + "): the replay only propagates them";
       }},
      // A roll-forward that left the run before the failure explains nothing about the run's failure.
      {C::kSystemTrajectoryDiverged, W::kAlways,
       [](const Finding& f, const ReplayReport& r) {
         // A checkpoint step off the log is a warning beside the verdict, not a roll-forward that left the run.
         if (f.evidence.text(K::kReplayedFrom) == std::optional<std::string>("checkpoint")) return false;
         return !r.first_nonfinite || f.evidence.integer(K::kStep).value_or(0) <= r.first_nonfinite->step;
       },
       [](const Finding& f, const ReplayReport&) {
         return "the roll-forward no longer follows the run from step " +
                std::to_string(f.evidence.integer(K::kStep).value_or(-1)) +
                ": what the replay shows from there is its own trajectory (see the finding for the causes)";
       }},
      // One a step's batch reads stops that step; one no step reads explains nothing about the replay.
      {C::kDataTokenOutOfRange, W::kAlways, [](const Finding& f, const ReplayReport&) { return f.evidence.has(K::kStep); },
       [](const Finding& f, const ReplayReport&) { return "poisoned data: " + f.message; }},
      {C::kDataRepeatRun, W::kWithOrigin,
       [](const Finding& f, const ReplayReport& r) { return is_error(f, r) && f.evidence.integer(K::kSample) == r.first_nonfinite->sample; },
       [](const Finding& f, const ReplayReport& r) { return poisoned_sample_summary(f, r); }},
      {C::kDataLowEntropy, W::kWithOrigin,
       [](const Finding& f, const ReplayReport& r) { return is_error(f, r) && f.evidence.integer(K::kSample) == r.first_nonfinite->sample; },
       [](const Finding& f, const ReplayReport& r) { return poisoned_sample_summary(f, r); }},
      {C::kDataTokenEmbeddingOutlier, W::kWithOrigin, any,
       [](const Finding& f, const ReplayReport& r) {
         return "poisoned token: " + f.message + "; it drives the first non-finite value at " + origin_site(r);
       }},
      {C::kNumericZeroNorm, W::kWithOrigin,
       [](const Finding& f, const ReplayReport& r) { return is_error(f, r) && at_origin_step(f, r); },
       [](const Finding& f, const ReplayReport&) { return "zero-norm denominator: " + f.message; }},
      {C::kNumericFp8ScaleJump, W::kWithOrigin, at_origin_step,
       [](const Finding& f, const ReplayReport&) { return "an fp8 scaling factor jumped into the failing step: " + f.message; }},
      {C::kNumericOverflow, W::kWithOrigin, is_error,
       [](const Finding& f, const ReplayReport&) { return "numeric overflow: " + f.message; }},
      {C::kSystemNotReproducible, W::kWithoutOrigin, is_error,
       [](const Finding& f, const ReplayReport&) { return "not reproducible: " + f.message; }},
      {C::kSystemRankMismatch, W::kWithoutOrigin, any,
       [](const Finding& f, const ReplayReport&) { return "one rank disagrees with its own replay: " + f.message; }},
  };
  return rules;
}

}  // namespace

RootCause decide_root_cause(const ReplayReport& report) {
  const bool origin = report.first_nonfinite.has_value();
  for (const RootCauseRule& rule : root_cause_rules()) {
    if (rule.when == RootCauseRule::When::kWithOrigin && !origin) continue;
    if (rule.when == RootCauseRule::When::kWithoutOrigin && origin) continue;
    for (const Finding& f : report.findings) {
      if (f.code == rule.code && rule.accepts(f, report)) return {f.layer(), f.code, rule.summary(f, report)};
    }
  }
  if (origin) {
    const FirstNonfinite& first = *report.first_nonfinite;
    return {TriageLayer::kNumeric, std::nullopt,
            "a non-finite value is first produced at " + first.name() + " (step " + std::to_string(first.step) + ", " +
                phase_name(first.phase) + ")"};
  }
  // Nothing went non-finite: any data error, then any error or warning, then handled fp16 overflow.
  for (const Finding& f : report.findings) {
    if (f.layer() == TriageLayer::kData && f.severity == Severity::kError) return {f.layer(), f.code, f.message};
  }
  for (const Severity severity : {Severity::kError, Severity::kWarning}) {
    for (const Finding& f : report.findings) {
      // An error still fails the run (exit 1); a warning in a clean window is no cause, only worth a look.
      const char* lead = severity == Severity::kError ? "nothing went non-finite, but: "
                                                      : "nothing went non-finite; worth a look: ";
      if (f.severity == severity) return {f.layer(), f.code, lead + f.message};
    }
  }
  for (const Finding& f : report.findings) {
    if (f.code == FindingCode::kNumericLossScaleOverflow) {
      return {f.layer(), f.code, "only handled fp16 overflow: the loss scaler skips those steps"};
    }
  }
  return {TriageLayer::kNumeric, std::nullopt, "no fault found in the replayed window"};
}

void order_findings(std::vector<Finding>& findings) {
  std::stable_sort(findings.begin(), findings.end(), [](const Finding& a, const Finding& b) {
    return static_cast<int>(a.layer()) < static_cast<int>(b.layer());
  });
}

}  // namespace nanreplay
