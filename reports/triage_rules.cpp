// Triage rules over plain data; see triage_rules.h.
#include "reports/triage_rules.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "reports/number_text.h"

namespace nanreplay {

namespace {

double relative_difference(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-12);
}

double dtype_limit(Compute compute) {
  return compute == Compute::kFp16 ? 65504.0
         : compute == Compute::kBf16 ? 3.3895313892515355e38
                                     : 3.4028234663852886e38;
}

std::string where_text(const ProbeRecord& r) {
  std::ostringstream out;
  out << r.site;
  if (r.first_head >= 0) out << " (head " << r.first_head << ")";
  out << ", step " << r.step << " " << phase_name(r.phase);
  if (r.phase != Phase::kGrad) out << ", micro-batch " << r.micro_batch << ", rank " << r.rank;
  return out.str();
}

const Finding* find_code(const ReplayReport& report, const std::string& code) {
  for (const Finding& f : report.findings) {
    if (f.code == code) return &f;
  }
  return nullptr;
}

// The first finding of `code` that is an error, not context.
const Finding* find_error(const ReplayReport& report, const std::string& code) {
  for (const Finding& f : report.findings) {
    if (f.code == code && f.severity == Severity::kError) return &f;
  }
  return nullptr;
}

}  // namespace

TriageThresholds default_thresholds(Compute compute) {
  TriageThresholds t;
  if (compute != Compute::kFp32) t.loss_rel_tol = 1e-2;
  return t;
}

Finding make_finding(TriageLayer layer, const std::string& code, Severity severity,
                     const std::string& message, nlohmann::json evidence) {
  Finding f;
  f.layer = layer;
  f.code = code;
  f.severity = severity;
  f.message = message;
  f.evidence = std::move(evidence);
  return f;
}

// The per-head record of `whole`'s first head: its own counts.
const ProbeRecord* head_record(const std::vector<ProbeRecord>& records, const ProbeRecord& whole) {
  if (whole.first_head < 0) return nullptr;
  for (const ProbeRecord& r : records) {
    if (r.head == whole.first_head && r.step == whole.step && r.phase == whole.phase && r.order == whole.order &&
        r.rank == whole.rank && r.micro_batch == whole.micro_batch) {
      return &r;
    }
  }
  return nullptr;
}

std::vector<Finding> overflow_findings(const std::vector<ProbeRecord>& records, int64_t step,
                                       bool handled_by_scaler, Compute compute,
                                       const TriageThresholds& t) {
  const ProbeRecord* first_inf = nullptr;
  const ProbeRecord* tightest = nullptr;
  for (const ProbeRecord& r : records) {
    if (r.head != -1) continue;
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
    // A per-head site: the count of the head named, and the site's total beside it.
    const ProbeRecord* head = head_record(records, *first_inf);
    const int64_t count = head != nullptr ? head->stats.inf_count : first_inf->stats.inf_count;
    const std::string total = head != nullptr && count != first_inf->stats.inf_count
                                  ? " (" + std::to_string(first_inf->stats.inf_count) + " over all heads)"
                                  : "";
    return {make_finding(
        TriageLayer::kNumeric, "NUMERIC_OVERFLOW", Severity::kError,
        where_text(*first_inf) + " reached the " + compute_name(compute) + " limit " +
            format_number(limit) + ": " + std::to_string(count) + " element(s) overflowed to inf" + total,
        {{"step", step}, {"site", first_inf->site}, {"phase", phase_name(first_inf->phase)},
         {"head", optional_index(first_inf->first_head)}, {"micro_batch", optional_index(first_inf->micro_batch)},
         {"rank", optional_index(first_inf->rank)}, {"sample", optional_index(first_inf->sample)},
         {"position", optional_index(first_inf->position)}, {"expected", limit}, {"after", "inf"},
         {"length", count}, {"site_length", first_inf->stats.inf_count}})};
  }
  if (tightest != nullptr && tightest->headroom_bits < t.headroom_warn_bits) {
    return {make_finding(
        TriageLayer::kNumeric, "NUMERIC_HEADROOM_LOW", Severity::kWarning,
        where_text(*tightest) + " came within " + format_number(tightest->headroom_bits) +
            " bits of the " + compute_name(compute) + " limit (max |x| " +
            format_number(tightest->stats.max_abs) + "): a near miss",
        {{"step", step}, {"site", tightest->site}, {"micro_batch", tightest->micro_batch},
         {"rank", tightest->rank}, {"after", tightest->stats.max_abs}, {"expected", limit},
         {"headroom_bits", tightest->headroom_bits}})};
  }
  return {};
}

std::vector<Finding> zero_norm_findings(const std::vector<NormCheck>& checks) {
  std::vector<Finding> findings;
  std::map<std::pair<int64_t, std::string>, bool> seen;
  for (const NormCheck& c : checks) {
    if (!c.zero_denominator && c.rows_below_eps == 0) continue;
    if (!seen.emplace(std::make_pair(c.step, c.site), true).second) continue;
    const Severity severity = c.zero_denominator ? Severity::kError : Severity::kWarning;
    const std::string moment = c.moment;
    const std::string what = c.zero_denominator
                                 ? "has a zero denominator (" + moment + " + eps = 0): 0/0 gives NaN"
                                 : "has " + std::to_string(c.rows_below_eps) + " row(s) whose " + moment +
                                       " is below eps " + format_number(c.eps);
    findings.push_back(make_finding(
        TriageLayer::kNumeric, "NUMERIC_ZERO_NORM", severity,
        c.site + " " + what + " at step " + std::to_string(c.step) + " (sample " +
            std::to_string(c.sample) + ", position " + std::to_string(c.position) + ")",
        {{"step", c.step}, {"site", c.site}, {"micro_batch", c.micro_batch}, {"rank", c.rank},
         {"sample", optional_index(c.sample)}, {"position", optional_index(c.position)},
         {"expected", c.eps}, {"after", json_number(c.min_moment)}, {"length", c.rows_below_eps},
         {"tensor", c.moment}}));
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
        findings.push_back(make_finding(
            TriageLayer::kNumeric, "NUMERIC_FP8_SCALE_JUMP", Severity::kWarning,
            module + " " + tensor + " scale jumped from " + format_number(a) + " at step " +
                std::to_string(before.step) + " to " + format_number(b) + " at step " +
                std::to_string(after.step) +
                (sane ? " (x" + format_number(ratio) + ")" : " (not a finite positive scale)"),
            {{"param", module}, {"tensor", tensor}, {"step", after.step},
             {"before", json_number(a)}, {"after", json_number(b)}}));
      }
    }
  }
  return findings;
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
      const bool agree = (std::isnan(ours) && std::isnan(theirs)) || ours == theirs ||
                         (std::isfinite(ours) && std::isfinite(theirs) &&
                          relative_difference(ours, theirs) <= t.loss_rel_tol);
      if (agree) continue;
      findings.push_back(make_finding(
          TriageLayer::kSystem, "SYSTEM_RANK_MISMATCH", Severity::kError,
          "step " + std::to_string(s.step) + ": rank " + std::to_string(r) + " logged " + what + " " +
              format_number(theirs) + " but replaying its share gives " + format_number(ours),
          {{"step", s.step}, {"rank", r}, {"tensor", what}, {"expected", json_number(ours)},
           {"after", json_number(theirs)}}));
    }
  };
  compare("loss", s.rank_losses, state.logged.rank_losses);
  compare("grad_norm", s.rank_grad_norms, state.logged.rank_grad_norms);
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
    findings.push_back(make_finding(
        TriageLayer::kData, "DATA_LOSS_OUTLIER", Severity::kWarning,
        "step " + std::to_string(step) + ": " + std::to_string(nonfinite.size()) +
            " sample(s) have a non-finite loss, first sample " + std::to_string(nonfinite.front()),
        {{"step", step}, {"sample", nonfinite.front()}, {"samples", listed},
         {"length", nonfinite.size()}}));
  }
  const RobustBaseline base = robust_baseline(finite);  // median and MAD of the losses
  if (base.samples < 8) return findings;
  for (const SampleLoss& l : losses) {
    if (!std::isfinite(l.loss)) continue;
    const double above = l.loss - base.median;
    const double scale = 1.4826 * base.mad;
    const double z = scale > 0 ? above / scale : (above > 0 ? INFINITY : 0.0);
    if (z > t.loss_outlier_z && above > t.loss_outlier_nats) {
      findings.push_back(make_finding(
          TriageLayer::kData, "DATA_LOSS_OUTLIER", Severity::kWarning,
          "step " + std::to_string(step) + ": sample " + std::to_string(l.sample) + " has loss " +
              format_number(l.loss) + ", far above the median " + format_number(base.median),
          {{"step", step}, {"sample", l.sample}, {"rank", l.rank}, {"micro_batch", l.micro_batch},
           {"expected", base.median}, {"after", l.loss}}));
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
      findings.push_back(make_finding(
          TriageLayer::kData, "DATA_REPEAT_RUN", Severity::kInfo,
          "sample " + std::to_string(p.sample) + " (step " + std::to_string(step) + ") repeats token " +
              std::to_string(p.run_token) + " " + std::to_string(p.longest_run) +
              " times from position " + std::to_string(p.run_position) + " (the stream's samples typically " +
              format_number(baseline.longest_run.median) + ")",
          {{"step", step}, {"sample", p.sample}, {"position", p.run_position},
           {"length", p.longest_run}, {"token", p.run_token}, {"expected", threshold},
           {"typical", baseline.longest_run.median}}));
    }
    if (is_low_entropy(p, baseline.entropy, o)) {
      findings.push_back(make_finding(
          TriageLayer::kData, "DATA_LOW_ENTROPY", Severity::kInfo,
          "sample " + std::to_string(p.sample) + " (step " + std::to_string(step) + ") has token entropy " +
              format_number(p.entropy_bits) + " bits against a typical " + format_number(baseline.entropy.median) +
              " (robust z " + format_number(baseline.entropy.z_below(p.entropy_bits)) + ")",
          {{"step", step}, {"sample", p.sample}, {"expected", baseline.entropy.median},
           {"after", p.entropy_bits}, {"z", baseline.entropy.z_below(p.entropy_bits)}}));
    }
  }
  return findings;
}

std::vector<PropagationEntry> propagation_after(const std::vector<ProbeRecord>& records,
                                                const ProbeRecord& origin, size_t limit) {
  std::vector<const ProbeRecord*> after;
  for (const ProbeRecord& r : records) {
    if (r.head != -1 || r.stats.all_finite() || r.step != origin.step) continue;
    const bool same_pass = r.phase == Phase::kGrad ||
                           (r.micro_batch == origin.micro_batch && r.rank == origin.rank);
    if (same_pass && execution_key(origin) < execution_key(r)) after.push_back(&r);
  }
  std::sort(after.begin(), after.end(),
            [](const ProbeRecord* a, const ProbeRecord* b) { return execution_key(*a) < execution_key(*b); });
  std::vector<PropagationEntry> path;
  for (const ProbeRecord* r : after) {
    if (path.size() == limit) break;
    path.push_back({r->phase, r->site, r->layer, r->first_head, r->stats.first_kind, r->stats.nan_count,
                    r->stats.inf_count});
  }
  return path;
}

RootCause decide_root_cause(const ReplayReport& report) {
  auto from = [](const Finding& f, const std::string& summary) {
    return RootCause{f.layer, f.code, summary};
  };
  if (const Finding* f = find_code(report, "BUNDLE_CHECKSUM_MISMATCH")) {
    return from(*f, "the bundle's data differs from what the job read (" + f->message + ")");
  }
  // Nothing else holds when the replay does not replay the run.
  if (const Finding* f = find_code(report, "BUNDLE_DOES_NOT_REPRODUCE")) {
    return from(*f, "the bundle does not describe the run: " + std::to_string(f->evidence.value("length", 0)) +
                        " of " + std::to_string(f->evidence.value("checked_steps", 0)) +
                        " healthy step(s) miss what the job logged, so no verdict about the failure holds until "
                        "the bundle matches the job (see the finding for what to check)");
  }
  if (const Finding* f = find_code(report, "SYSTEM_BIT_FLIP")) {
    return from(*f, "hardware: a single flipped bit in " + f->evidence.value("param", std::string("a weight")) +
                        " (bit " + f->evidence["bit"].dump() + ", first held by the checkpoint of step " +
                        f->evidence["step"].dump() + "): silent data corruption, not the model or the data");
  }
  if (const Finding* f = find_error(report, "CHECKPOINT_NONFINITE")) {
    return from(*f, "the checkpoint itself already holds non-finite values (" + f->message +
                        "): the replay only propagates them");
  }
  for (const Finding& f : report.findings) {
    // One a step's batch reads stops that step; one no step reads is reported
    // (below, as a data error) but explains nothing about the replay.
    if (f.code == "DATA_TOKEN_OUT_OF_RANGE" && f.evidence.contains("step")) {
      return from(f, "poisoned data: " + f.message);
    }
  }
  if (report.first_nonfinite) {
    const FirstNonfinite& first = *report.first_nonfinite;
    for (const Finding& f : report.findings) {
      const bool poison = f.code == "DATA_REPEAT_RUN" || f.code == "DATA_LOW_ENTROPY";
      if (poison && f.severity == Severity::kError && f.evidence.value("sample", int64_t{-2}) == first.sample) {
        return from(f, "poisoned sample " + std::to_string(first.sample) + " (" + f.message +
                           ") drives the first non-finite value at " + first.site);
      }
    }
    if (const Finding* f = find_code(report, "DATA_TOKEN_EMBEDDING_OUTLIER")) {
      return from(*f, "poisoned token: " + f->message + "; it drives the first non-finite value at " + first.site);
    }
    for (const Finding& f : report.findings) {
      if (f.code == "NUMERIC_ZERO_NORM" && f.severity == Severity::kError &&
          f.evidence.value("step", int64_t{-1}) == first.step) {
        return from(f, "zero-norm denominator: " + f.message);
      }
    }
    for (const Finding& f : report.findings) {
      if (f.code == "NUMERIC_FP8_SCALE_JUMP" && f.evidence.value("step", int64_t{-1}) == first.step) {
        return from(f, "an fp8 scaling factor jumped into the failing step: " + f.message);
      }
    }
    if (const Finding* f = find_error(report, "NUMERIC_OVERFLOW")) {
      return from(*f, "numeric overflow: " + f->message);
    }
    return RootCause{TriageLayer::kNumeric, "NONFINITE",
                     "a non-finite value is first produced at " + first.site + " (step " +
                         std::to_string(first.step) + ", " + phase_name(first.phase) + ")"};
  }
  if (const Finding* f = find_error(report, "SYSTEM_NOT_REPRODUCIBLE")) {
    return from(*f, "not reproducible: " + f->message);
  }
  if (const Finding* f = find_code(report, "SYSTEM_RANK_MISMATCH")) {
    return from(*f, "one rank disagrees with its own replay: " + f->message);
  }
  for (const Finding& f : report.findings) {
    if (f.layer == TriageLayer::kData && f.severity == Severity::kError) return from(f, f.message);
  }
  for (const Severity severity : {Severity::kError, Severity::kWarning}) {
    for (const Finding& f : report.findings) {
      if (f.severity == severity) return from(f, "nothing went non-finite, but: " + f.message);
    }
  }
  if (const Finding* f = find_code(report, "NUMERIC_LOSS_SCALE_OVERFLOW")) {
    return from(*f, "only handled fp16 overflow: the loss scaler skips those steps");
  }
  return RootCause{TriageLayer::kNumeric, "NONE", "no fault found in the replayed window"};
}

void order_findings(std::vector<Finding>& findings) {
  std::stable_sort(findings.begin(), findings.end(), [](const Finding& a, const Finding& b) {
    return static_cast<int>(a.layer) < static_cast<int>(b.layer);
  });
}

}  // namespace nanreplay
