// See site_stats_summary.h. Pooling: max of the maxima, and the rms of the
// union of elements (sums of squares and finite counts added up).
#include "probes/site_stats_summary.h"

#include <algorithm>
#include <cmath>

namespace nanreplay {

namespace {

struct PooledStat {
  double max_abs = 0.0, sum_sq = 0.0;
  int64_t finite = 0;
  void add(const TensorStats& s) {
    max_abs = std::max(max_abs, s.max_abs);
    sum_sq += s.sum_sq;
    finite += s.finite_count;
  }
  LoggedSiteStat logged() const { return {max_abs, finite > 0 ? std::sqrt(sum_sq / double(finite)) : 0.0}; }
};

struct PooledSite {
  PooledStat whole;
  std::map<int, PooledStat> heads, experts;
};

std::vector<LoggedSiteStat> indexed_stats(const std::map<int, PooledStat>& parts) {
  std::vector<LoggedSiteStat> out;
  for (const auto& [index, stat] : parts) {
    out.resize(static_cast<size_t>(index) + 1);
    out[static_cast<size_t>(index)] = stat.logged();
  }
  return out;
}

}  // namespace

std::map<std::string, LoggedSiteStats> summarize_forward_sites(const std::vector<ProbeRecord>& records) {
  std::map<std::string, PooledSite> pooled;
  for (const ProbeRecord& r : records) {
    if (r.phase != Phase::kForward) continue;
    PooledSite& site = pooled[site_name(r.site)];
    if (r.head >= 0) site.heads[r.head].add(r.stats);
    else if (r.expert >= 0) site.experts[r.expert].add(r.stats);
    else site.whole.add(r.stats);
  }
  std::map<std::string, LoggedSiteStats> out;
  for (const auto& [name, site] : pooled) out[name] = {site.whole.logged(), indexed_stats(site.heads), indexed_stats(site.experts)};
  return out;
}

}  // namespace nanreplay
