#include "reports/triage/system/probe_comparison.h"

#include <cstring>

namespace nanreplay {

using K = EvidenceKey;

bool same_stats(const TensorStats& a, const TensorStats& b) {
  auto bits_equal = [](double x, double y) { return std::memcmp(&x, &y, sizeof x) == 0; };
  return a.count == b.count && a.finite_count == b.finite_count && a.nan_count == b.nan_count &&
         a.inf_count == b.inf_count && a.first_nonfinite == b.first_nonfinite && a.first_kind == b.first_kind &&
         bits_equal(a.max_abs, b.max_abs) &&
         bits_equal(a.min_nonzero_abs, b.min_nonzero_abs) && bits_equal(a.sum, b.sum) &&
         bits_equal(a.sum_sq, b.sum_sq);
}

ProbeDifference ProbeComparison::where() const {
  if (a == nullptr) return {};
  return {phase_name(a->phase), probe_name(*a), a->rank, a->micro_batch, a->head, a->expert};
}

ProbeComparison compare_probes(const std::vector<const ProbeRecord*>& before, const std::vector<ProbeRecord>& again) {
  ProbeComparison result;
  result.compared = static_cast<int64_t>(before.size());
  if (before.size() != again.size()) {
    result.difference = "probe count " + std::to_string(before.size()) + " vs " + std::to_string(again.size());
    return result;
  }
  for (size_t i = 0; i < before.size(); ++i) {
    const ProbeRecord& a = *before[i];
    const ProbeRecord& b = again[i];
    if (!(a.site == b.site) || a.param != b.param || a.phase != b.phase || a.head != b.head || a.expert != b.expert ||
        !same_stats(a.stats, b.stats)) {
      result.a = &a;
      result.b = &b;
      result.difference = std::string(phase_name(a.phase)) + " " + probe_name(a);
      return result;
    }
  }
  return result;
}

Evidence difference_evidence(int64_t step, const ProbeDifference& where) {
  Evidence evidence = {{K::kStep, step}};
  if (where.site.empty()) return evidence;  // the replays probed different numbers of tensors
  return evidence.set(K::kPhase, where.phase)
      .set(K::kSite, where.site)
      .set(K::kRank, optional_index_value(where.rank))
      .set(K::kMicroBatch, optional_index_value(where.micro_batch))
      .set(K::kHead, optional_index_value(where.head))
      .set(K::kExpert, optional_index_value(where.expert));
}

}  // namespace nanreplay
