// See window_outliers.h; docs/spikes.md, "What changed".
#include "reports/triage/window_outliers.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "reports/triage/spike_origin.h"

namespace nanreplay {

namespace {

using OutlierKey = std::pair<int, int>;
using StepValues = std::map<OutlierKey, double>;

void keep_larger(StepValues& values, const OutlierKey& key, double value) {
  const auto [at, added] = values.emplace(key, value);
  if (!added) at->second = std::max(at->second, value);
}

std::optional<double> ratio_of(double later, double earlier) {
  if (!std::isfinite(later) || !std::isfinite(earlier) || earlier <= 0) return std::nullopt;
  return later / earlier;
}

// The keys of the last step's values, largest first, at most `count`.
std::vector<OutlierKey> largest_keys(const StepValues& last, size_t count) {
  std::vector<std::pair<double, OutlierKey>> ranked;
  for (const auto& [key, v] : last) ranked.push_back({v, key});
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<OutlierKey> keys;
  for (size_t i = 0; i < ranked.size() && i < count; ++i) keys.push_back(ranked[i].second);
  return keys;
}

// One key's value per step (NaN where a step did not probe it).
template <typename Steps, typename Pick>
std::vector<double> series_of(const Steps& steps, const OutlierKey& key, Pick pick) {
  std::vector<double> series;
  for (const auto* s : steps) {
    const StepValues& values = pick(*s);
    const auto found = values.find(key);
    series.push_back(found == values.end() ? std::numeric_limits<double>::quiet_NaN() : found->second);
  }
  return series;
}

// The last healthy step's value over the first's, and the last step's over
// the one before (the spike step's jump), where the window has them.
void growth_of(const std::vector<double>& series, bool spike_last, std::optional<double>& healthy,
               std::optional<double>& jump) {
  const size_t healthy_count = series.size() - (spike_last ? 1 : 0);
  if (healthy_count >= 2) healthy = ratio_of(series[healthy_count - 1], series.front());
  if (spike_last && series.size() >= 2) jump = ratio_of(series.back(), series[series.size() - 2]);
}

}  // namespace

void OutlierTracker::step_done(int64_t step, const std::vector<ProbeRecord>& records,
                               const std::vector<std::vector<double>>& router_logit_max,
                               std::optional<int64_t> last_step) {
  if (last_step && step > *last_step) return;
  StepMaxima kept;
  kept.step = step;
  for (size_t layer = 0; layer < router_logit_max.size(); ++layer) {
    for (size_t e = 0; e < router_logit_max[layer].size(); ++e) {
      const double v = router_logit_max[layer][e];
      if (std::isfinite(v)) kept.router_logit[{static_cast<int>(layer), static_cast<int>(e)}] = v;
    }
  }
  for (const ProbeRecord& r : records) {
    if (r.phase != Phase::kForward || r.stats.finite_count == 0) continue;
    const SiteId id = r.site.id;
    if (r.head >= 0 && id == SiteId::kAttnScores) keep_larger(kept.head_logit, {r.layer, r.head}, r.stats.max_abs);
    if (r.expert >= 0 && id == SiteId::kMlpExpertAct) keep_larger(kept.expert_act, {r.layer, r.expert}, r.stats.max_abs);
    if (r.expert >= 0 && id == SiteId::kMlpExpertDown) keep_larger(kept.expert_down, {r.layer, r.expert}, r.stats.max_abs);
  }
  steps_.push_back(std::move(kept));
  if (steps_.size() > kSpikeHistorySteps) steps_.erase(steps_.begin());
}

std::vector<const OutlierTracker::StepMaxima*> OutlierTracker::steps_until(std::optional<int64_t> spike_step) const {
  std::vector<const StepMaxima*> kept;
  for (const StepMaxima& s : steps_) {
    if (!spike_step || s.step <= *spike_step) kept.push_back(&s);
  }
  return kept;
}

WindowOutliers OutlierTracker::summary(std::optional<int64_t> spike_step) const {
  WindowOutliers out;
  const std::vector<const StepMaxima*> steps = steps_until(spike_step);
  if (steps.empty()) return out;
  for (const StepMaxima* s : steps) out.steps.push_back(s->step);
  const bool spike_last = spike_step && steps.back()->step == *spike_step;
  auto heads = [](const StepMaxima& s) -> const StepValues& { return s.head_logit; };
  for (const OutlierKey& key : largest_keys(steps.back()->head_logit, kOutlierHeadsListed)) {
    HeadLogitSeries h{key.first, key.second, series_of(steps, key, heads), std::nullopt, std::nullopt};
    growth_of(h.max_logit, spike_last, h.healthy_growth, h.spike_jump);
    out.heads.push_back(std::move(h));
  }
  auto act = [](const StepMaxima& s) -> const StepValues& { return s.expert_act; };
  auto down = [](const StepMaxima& s) -> const StepValues& { return s.expert_down; };
  auto router = [](const StepMaxima& s) -> const StepValues& { return s.router_logit; };
  for (const OutlierKey& key : largest_keys(steps.back()->expert_act, kOutlierExpertsListed)) {
    ExpertOutlierSeries e{key.first,          key.second, series_of(steps, key, act), series_of(steps, key, down),
                          series_of(steps, key, router), std::nullopt};
    std::optional<double> unused;
    growth_of(e.act_max, spike_last, unused, e.spike_jump);
    out.experts.push_back(std::move(e));
  }
  return out;
}

std::optional<LogitGrowthMechanism> OutlierTracker::logit_growth(const SpikeOrigin& origin) const {
  if (origin.site.id != SiteId::kAttnScores || origin.head < 0) return std::nullopt;
  const std::vector<const StepMaxima*> steps = steps_until(origin.step);
  if (steps.empty() || steps.back()->step != origin.step) return std::nullopt;
  auto heads = [](const StepMaxima& s) -> const StepValues& { return s.head_logit; };
  const std::vector<double> series = series_of(steps, {origin.layer, origin.head}, heads);
  std::optional<double> healthy, jump;
  growth_of(series, true, healthy, jump);
  if (!healthy || !jump || *healthy < kLogitGrowthHealthyFactor) return std::nullopt;
  return LogitGrowthMechanism{origin.layer, origin.head, *healthy, *jump};
}

}  // namespace nanreplay
