// Triage rules over plain data; see triage_rules.h.
#include "reports/triage/triage_rules.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "reports/results/logged_value.h"
#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

double dtype_limit(Compute compute) {
  return compute == Compute::kFp16 ? 65504.0
         : compute == Compute::kBf16 ? 3.3895313892515355e38
                                     : 3.4028234663852886e38;
}

std::string where_text(const ProbeRecord& r) {
  std::ostringstream out;
  out << probe_name(r);
  if (r.first_head >= 0) out << " (head " << r.first_head << ")";
  if (r.first_expert >= 0) out << " (expert " << r.first_expert << ")";
  out << ", step " << r.step << " " << phase_name(r.phase);
  if (r.phase != Phase::kGrad) out << ", micro-batch " << r.micro_batch << ", rank " << r.rank;
  return out.str();
}

}  // namespace

TriageThresholds default_thresholds(Compute compute) {
  TriageThresholds t;
  if (compute != Compute::kFp32) {
    t.loss_rel_tol = 1e-2;
    t.trajectory_rel_tol = 5e-2;
  }
  return t;
}

// The per-head (per-expert) record of `whole`'s first head (expert): its own counts.
const ProbeRecord* part_record(const std::vector<ProbeRecord>& records, const ProbeRecord& whole) {
  if (whole.first_head < 0 && whole.first_expert < 0) return nullptr;
  for (const ProbeRecord& r : records) {
    const bool part = whole.first_head >= 0 ? r.head == whole.first_head : r.expert == whole.first_expert;
    if (part && r.step == whole.step && r.phase == whole.phase && r.order == whole.order &&
        r.rank == whole.rank && r.micro_batch == whole.micro_batch) {
      return &r;
    }
  }
  return nullptr;
}

// The per-head (per-expert) record of `whole` that holds its largest |x|: where a near miss is.
const ProbeRecord* largest_part(const std::vector<ProbeRecord>& records, const ProbeRecord& whole) {
  for (const ProbeRecord& r : records) {
    if (!is_whole(r) && r.step == whole.step && r.phase == whole.phase && r.order == whole.order &&
        r.rank == whole.rank && r.micro_batch == whole.micro_batch && r.stats.max_abs == whole.stats.max_abs) {
      return &r;
    }
  }
  return nullptr;
}

namespace {

// What the elements overflowed to: inf_count holds both signs, and the
// first element's kind says which one it was.
std::string overflow_target(const ProbeRecord& r, int64_t count) {
  if (r.stats.first_kind != NonfiniteKind::kNegInf) return "inf";
  return count == 1 ? "-inf" : "+inf or -inf (the first to -inf)";
}

}  // namespace

std::vector<Finding> overflow_findings(const std::vector<ProbeRecord>& records, int64_t step,
                                       bool handled_by_scaler, Compute compute,
                                       const TriageThresholds& t) {
  const ProbeRecord* first_inf = nullptr;
  const ProbeRecord* tightest = nullptr;
  for (const ProbeRecord& r : records) {
    if (!is_whole(r)) continue;
    if (r.stats.inf_count > 0 && (first_inf == nullptr || execution_key(r) < execution_key(*first_inf))) {
      first_inf = &r;
    }
    if (r.phase == Phase::kForward && r.stats.all_finite() &&
        (tightest == nullptr || r.headroom_bits < tightest->headroom_bits)) {
      tightest = &r;
    }
  }
  const double limit = dtype_limit(compute);
  if (first_inf != nullptr) {
    if (handled_by_scaler) return {};  // the loss scaler's business, reported as such
    // A per-head (per-expert) site: the count of the head (expert) named, and the site's total beside it.
    const ProbeRecord* part = part_record(records, *first_inf);
    const int64_t count = part != nullptr ? part->stats.inf_count : first_inf->stats.inf_count;
    const std::string total = part != nullptr && count != first_inf->stats.inf_count
                                  ? " (" + std::to_string(first_inf->stats.inf_count) + " over all " +
                                        (part->head >= 0 ? "heads)" : "experts)")
                                  : "";
    return {make_finding(FindingCode::kNumericOverflow, Severity::kError,
        where_text(*first_inf) + " reached the " + compute_name(compute) + " limit " +
            format_number(limit) + ": " + std::to_string(count) + " element(s) overflowed to " +
            overflow_target(part != nullptr ? *part : *first_inf, count) + total,
        {{K::kStep, step}, {K::kSite, probe_name(*first_inf)}, {K::kPhase, phase_name(first_inf->phase)},
         {K::kHead, optional_index_value(first_inf->first_head)}, {K::kExpert, optional_index_value(first_inf->first_expert)},
         {K::kMicroBatch, optional_index_value(first_inf->micro_batch)},
         {K::kRank, optional_index_value(first_inf->rank)}, {K::kSample, optional_index_value(first_inf->sample)},
         {K::kPosition, optional_index_value(first_inf->position)}, {K::kExpected, limit},
         {K::kAfter, first_inf->stats.first_kind == NonfiniteKind::kNegInf ? "-inf" : "inf"},
         {K::kLength, count}, {K::kSiteLength, first_inf->stats.inf_count}})};
  }
  if (tightest != nullptr && tightest->headroom_bits < t.headroom_warn_bits) {
    const ProbeRecord* part = largest_part(records, *tightest);
    const int head = part != nullptr ? part->head : -1;
    const int expert = part != nullptr ? part->expert : -1;
    const std::string which = head >= 0 ? " (head " + std::to_string(head) + ")"
                              : expert >= 0 ? " (expert " + std::to_string(expert) + ")" : "";
    return {make_finding(FindingCode::kNumericHeadroomLow, Severity::kWarning,
        where_text(*tightest) + which + " came within " + format_number(tightest->headroom_bits) +
            " bits of the " + compute_name(compute) + " limit (max |x| " +
            format_number(tightest->stats.max_abs) + "): a near miss",
        {{K::kStep, step}, {K::kSite, probe_name(*tightest)}, {K::kHead, optional_index_value(head)},
         {K::kExpert, optional_index_value(expert)}, {K::kMicroBatch, tightest->micro_batch},
         {K::kRank, tightest->rank}, {K::kAfter, tightest->stats.max_abs}, {K::kExpected, limit},
         {K::kHeadroomBits, tightest->headroom_bits}})};
  }
  return {};
}

std::vector<Finding> zero_norm_findings(const std::vector<NormCheck>& checks) {
  std::vector<Finding> findings;
  std::set<std::pair<int64_t, std::string>> seen;
  for (const NormCheck& c : checks) {
    if (!c.zero_denominator && c.rows_below_eps == 0) continue;
    const std::string site = site_name(c.site);
    if (!seen.emplace(c.step, site).second) continue;
    const Severity severity = c.zero_denominator ? Severity::kError : Severity::kWarning;
    const std::string moment = c.moment;
    const std::string what = c.zero_denominator
                                 ? "has a zero denominator (" + moment + " + eps = 0): 0/0 gives NaN"
                                 : "has " + std::to_string(c.rows_below_eps) + " row(s) whose " + moment +
                                       " is below eps " + format_number(c.eps);
    findings.push_back(make_finding(FindingCode::kNumericZeroNorm, severity,
        site + " " + what + " at step " + std::to_string(c.step) + " (sample " +
            std::to_string(c.sample) + ", position " + std::to_string(c.position) + ")",
        {{K::kStep, c.step}, {K::kSite, site}, {K::kMicroBatch, c.micro_batch}, {K::kRank, c.rank},
         {K::kSample, optional_index_value(c.sample)}, {K::kPosition, optional_index_value(c.position)},
         {K::kExpected, c.eps}, {K::kAfter, (c.min_moment)}, {K::kLength, c.rows_below_eps},
         {K::kTensor, c.moment}}));
  }
  return findings;
}

std::vector<Finding> fp8_scale_jump_findings(const std::vector<StepState>& states,
                                             const TriageThresholds& t) {
  std::vector<Finding> findings;
  for (size_t i = 1; i < states.size(); ++i) {
    const StepState& before = states[i - 1];
    const StepState& after = states[i];
    for (const auto& [module, scales] : after.fp8_scales) {
      const auto prior = before.fp8_scales.find(module);
      if (prior == before.fp8_scales.end()) continue;
      const std::pair<const char*, std::pair<std::optional<double>, std::optional<double>>> tensors[] = {
          {"input", {prior->second.input, scales.input}},
          {"weight", {prior->second.weight, scales.weight}},
          {"grad_output", {prior->second.grad_output, scales.grad_output}}};
      for (const auto& [tensor, pair] : tensors) {
        if (!pair.first || !pair.second) continue;
        const double a = *pair.first, b = *pair.second;
        const bool sane = std::isfinite(a) && std::isfinite(b) && a > 0 && b > 0;
        const double ratio = sane ? b / a : std::nan("");
        if (sane && ratio <= t.fp8_scale_jump && ratio >= 1.0 / t.fp8_scale_jump) continue;
        findings.push_back(make_finding(FindingCode::kNumericFp8ScaleJump, Severity::kWarning,
            module + " " + tensor + " scale jumped from " + format_number(a) + " at step " +
                std::to_string(before.step) + " to " + format_number(b) + " at step " +
                std::to_string(after.step) +
                (sane ? " (x" + format_number(ratio) + ")" : " (not a finite positive scale)"),
            {{K::kParam, module}, {K::kTensor, tensor}, {K::kStep, after.step},
             {K::kBefore, (a)}, {K::kAfter, (b)}}));
      }
    }
  }
  return findings;
}

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
  if (!s.rank_norms_logged_global) compare("grad_norm", s.rank_grad_norms, state.logged.rank_grad_norms);
  return findings;
}

std::vector<Finding> sample_loss_findings(const std::vector<SampleLoss>& losses, int64_t step,
                                          const TriageThresholds& t) {
  std::vector<double> finite;
  std::vector<int64_t> nonfinite;
  for (const SampleLoss& l : losses) {
    if (std::isfinite(l.loss)) finite.push_back(l.loss);
    else if (std::find(nonfinite.begin(), nonfinite.end(), l.sample) == nonfinite.end()) nonfinite.push_back(l.sample);
  }
  std::vector<Finding> findings;
  if (!nonfinite.empty()) {
    std::vector<int64_t> listed(nonfinite.begin(), nonfinite.begin() + std::min<size_t>(nonfinite.size(), 16));
    findings.push_back(make_finding(FindingCode::kDataLossOutlier, Severity::kWarning,
        "step " + std::to_string(step) + ": " + std::to_string(nonfinite.size()) +
            " sample(s) have a non-finite loss, first sample " + std::to_string(nonfinite.front()),
        {{K::kStep, step}, {K::kSample, nonfinite.front()}, {K::kSamples, listed},
         {K::kLength, nonfinite.size()}}));
  }
  const RobustBaseline base = robust_baseline(finite);  // median and MAD of the losses
  if (base.samples < 8) return findings;
  for (const SampleLoss& l : losses) {
    if (!std::isfinite(l.loss)) continue;
    const double above = l.loss - base.median;
    const double scale = 1.4826 * base.mad;
    const double z = scale > 0 ? above / scale : (above > 0 ? INFINITY : 0.0);
    if (z > t.loss_outlier_z && above > t.loss_outlier_nats) {
      findings.push_back(make_finding(FindingCode::kDataLossOutlier, Severity::kWarning,
          "step " + std::to_string(step) + ": sample " + std::to_string(l.sample) + " has loss " +
              format_number(l.loss) + ", far above the median " + format_number(base.median),
          {{K::kStep, step}, {K::kSample, l.sample}, {K::kRank, l.rank}, {K::kMicroBatch, l.micro_batch},
           {K::kExpected, base.median}, {K::kAfter, l.loss}}));
    }
  }
  return findings;
}

std::vector<Finding> sample_profile_findings(const std::vector<SampleProfile>& profiles,
                                             const DataBaseline& baseline, int64_t step,
                                             int64_t seq_len, const DataCheckOptions& o) {
  // Info until the verdict knows whether the sample is implicated (settle_verdict).
  std::vector<Finding> findings;
  const int64_t threshold = o.repeat_threshold(seq_len);
  for (const SampleProfile& p : profiles) {
    if (is_repeat_run(p, baseline.longest_run, seq_len, o)) {
      findings.push_back(make_finding(FindingCode::kDataRepeatRun, Severity::kInfo,
          "sample " + std::to_string(p.sample) + " (step " + std::to_string(step) + ") repeats token " +
              std::to_string(p.run_token) + " " + std::to_string(p.longest_run) +
              " times from position " + std::to_string(p.run_position) + " (the stream's samples typically " +
              format_number(baseline.longest_run.median) + ")",
          {{K::kStep, step}, {K::kSample, p.sample}, {K::kPosition, p.run_position},
           {K::kLength, p.longest_run}, {K::kToken, p.run_token}, {K::kExpected, threshold},
           {K::kTypical, baseline.longest_run.median}}));
    }
    if (is_low_entropy(p, baseline.entropy, o)) {
      findings.push_back(make_finding(FindingCode::kDataLowEntropy, Severity::kInfo,
          "sample " + std::to_string(p.sample) + " (step " + std::to_string(step) + ") has token entropy " +
              format_number(p.entropy_bits) + " bits against a typical " + format_number(baseline.entropy.median) +
              " (robust z " + format_number(baseline.entropy.z_below(p.entropy_bits)) + ")",
          {{K::kStep, step}, {K::kSample, p.sample}, {K::kExpected, baseline.entropy.median},
           {K::kAfter, p.entropy_bits}, {K::kZ, baseline.entropy.z_below(p.entropy_bits)}}));
    }
  }
  return findings;
}

std::vector<PropagationEntry> propagation_after(const std::vector<ProbeRecord>& records,
                                                const ProbeRecord& origin, size_t limit) {
  std::vector<const ProbeRecord*> after;
  for (const ProbeRecord& r : records) {
    if (!is_whole(r) || r.stats.all_finite() || r.step != origin.step) continue;
    const bool same_pass = r.phase == Phase::kGrad ||
                           (r.micro_batch == origin.micro_batch && r.rank == origin.rank);
    if (same_pass && execution_key(origin) < execution_key(r)) after.push_back(&r);
  }
  std::sort(after.begin(), after.end(),
            [](const ProbeRecord* a, const ProbeRecord* b) { return execution_key(*a) < execution_key(*b); });
  std::vector<PropagationEntry> path;
  for (const ProbeRecord* r : after) {
    if (path.size() == limit) break;
    path.push_back({r->phase, r->site, r->param, r->layer, r->first_head, r->stats.first_kind, r->stats.nan_count,
                    r->stats.inf_count, r->first_expert});
  }
  return path;
}

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
      {C::kCheckpointNonfinite, W::kAlways, is_error,
       [](const Finding& f, const ReplayReport&) {
         return "the checkpoint itself already holds non-finite values (" + f.message + "): the replay only propagates them";
       }},
      // A roll-forward that left the run before the failure explains nothing about the run's failure.
      {C::kSystemTrajectoryDiverged, W::kAlways,
       [](const Finding& f, const ReplayReport& r) {
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
