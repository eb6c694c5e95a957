// The numeric layer's rules over plain data; see numeric_rules.h.
#include "reports/triage/numeric/numeric_rules.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

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

Finding loss_scale_overflow_finding(const ProbeRecord& bad, const StepOutcome& outcome) {
  return make_finding(FindingCode::kNumericLossScaleOverflow,
                      "step " + std::to_string(outcome.step) + ": the backward overflowed at " + probe_name(bad) +
                          " with loss scale " + format_number(outcome.loss_scale) +
                          "; the loss scaler skips this step and halves the scale (handled, not the incident)",
                      {{K::kStep, outcome.step}, {K::kSite, probe_name(bad)}, {K::kHead, optional_index_value(bad.first_head)},
                       {K::kExpert, optional_index_value(bad.first_expert)}, {K::kRank, bad.rank}, {K::kMicroBatch, bad.micro_batch}, {K::kBefore, outcome.loss_scale},
                       {K::kAfter, outcome.loss_scale / 2}});
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
}  // namespace nanreplay
