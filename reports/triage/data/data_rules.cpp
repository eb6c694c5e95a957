// The data layer's rules over plain data; see data_rules.h.
#include "reports/triage/data/data_rules.h"

#include <algorithm>
#include <cmath>

#include "probes/robust_stats.h"
#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

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
    const double scale = kMadToSigma * base.mad;
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
bool is_embedding_outlier(double norm, double typical, double spread, const TriageThresholds& t) {
  if (!std::isfinite(norm)) return true;
  if (norm < t.embedding_outlier_ratio * typical) return false;
  const double scale = kMadToSigma * spread;
  return scale > 0 ? (norm - typical) / scale >= t.embedding_outlier_z : norm > typical;
}

}  // namespace nanreplay
