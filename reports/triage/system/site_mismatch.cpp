// See site_mismatch.h.
#include "reports/triage/system/site_mismatch.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "loaders/base/error.h"
#include "probes/site_stats_summary.h"
#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

double site_stat_tolerance(Compute compute) {
  switch (compute) {
    case Compute::kFp32: return 1e-3;
    case Compute::kBf16:
    case Compute::kFp16: return 2e-2;
    case Compute::kFp8: return 1e-1;
  }
  return 1e-3;
}

namespace {

struct SiteStatGap {
  const char* statistic;
  double logged, replayed;
};

// The first of max_abs, rms that differs beyond `tolerance` (relative to the larger).
std::optional<SiteStatGap> stat_gap(const LoggedSiteStat& logged, const LoggedSiteStat& replayed, double tolerance) {
  auto differs = [&](double a, double b) { return std::fabs(a - b) > tolerance * std::max(std::fabs(a), std::fabs(b)); };
  if (differs(logged.max_abs, replayed.max_abs)) return SiteStatGap{"max_abs", logged.max_abs, replayed.max_abs};
  if (differs(logged.rms, replayed.rms)) return SiteStatGap{"rms", logged.rms, replayed.rms};
  return std::nullopt;
}

// The first differing entry of a per-head / per-expert list: its index, and the gap.
std::optional<std::pair<int, SiteStatGap>> list_gap(int64_t step, const std::string& site, const char* key,
                                                    const std::vector<LoggedSiteStat>& logged,
                                                    const std::vector<LoggedSiteStat>& replayed, double tolerance) {
  if (logged.empty()) return std::nullopt;
  if (logged.size() != replayed.size()) {
    throw InputError("steps/" + std::to_string(step) + "/state.json",
                     "logged.site_stats[\"" + site + "\"]." + key,
                     "expected " + std::to_string(replayed.size()) + " entries (the site's " + key +
                         " count), got " + std::to_string(logged.size()));
  }
  for (size_t i = 0; i < logged.size(); ++i) {
    if (auto gap = stat_gap(logged[i], replayed[i], tolerance)) return std::make_pair(static_cast<int>(i), *gap);
  }
  return std::nullopt;
}

Finding site_mismatch(int64_t step, const std::string& site, int head, int expert, const SiteStatGap& gap,
                      double tolerance) {
  std::string where = site;
  if (head >= 0) where += " head " + std::to_string(head);
  if (expert >= 0) where += " expert " + std::to_string(expert);
  return make_finding(
      FindingCode::kSystemSiteMismatch, Severity::kError,
      "step " + std::to_string(step) + ": " + where + " replays to " + gap.statistic + " " +
          format_number(gap.replayed) + " where the run logged " + format_number(gap.logged) +
          " (beyond the rounding tolerance " + format_number(tolerance) +
          "): the first site where the training machine computed something else than the replay",
      {{K::kStep, step}, {K::kSite, site}, {K::kHead, optional_index_value(head)},
       {K::kExpert, optional_index_value(expert)}, {K::kExpected, gap.logged}, {K::kAfter, gap.replayed},
       {K::kStatistic, gap.statistic}, {K::kTolerance, tolerance}});
}

}  // namespace

std::vector<Finding> site_mismatch_findings(int64_t step, const StepState& state,
                                            const std::vector<ProbeRecord>& probes, const ModelConfig& model,
                                            Compute compute) {
  const auto& logged = state.logged.site_stats;
  if (logged.empty()) return {};
  const std::map<std::string, LoggedSiteStats> replayed = summarize_forward_sites(probes);
  if (replayed.empty()) return {};
  const double tolerance = site_stat_tolerance(compute);
  for (const SiteRef& ref : forward_sites(model)) {
    const std::string name = site_name(ref);
    const auto log = logged.find(name);
    const auto own = replayed.find(name);
    if (log == logged.end() || own == replayed.end()) continue;
    // A head or expert that differs names more than the whole site does.
    if (auto head = list_gap(step, name, "per_head", log->second.per_head, own->second.per_head, tolerance)) {
      return {site_mismatch(step, name, head->first, -1, head->second, tolerance)};
    }
    if (auto expert = list_gap(step, name, "per_expert", log->second.per_expert, own->second.per_expert, tolerance)) {
      return {site_mismatch(step, name, -1, expert->first, expert->second, tolerance)};
    }
    if (auto gap = stat_gap(log->second.whole, own->second.whole, tolerance)) {
      return {site_mismatch(step, name, -1, -1, *gap, tolerance)};
    }
  }
  return {};
}

}  // namespace nanreplay
