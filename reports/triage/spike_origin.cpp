// See spike_origin.h; docs/spikes.md explains the thresholds and how they
// were calibrated on the clean presets.
#include "reports/triage/spike_origin.h"

#include <algorithm>
#include <cmath>

#include "probes/robust_stats.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

bool usable_magnitude(double value) { return std::isfinite(value) && value > 0; }

// Probabilities (a head's attention, its sink's share, the router's) are
// shares of a row in [0, 1] that move with the data: in clean-gpt-oss-attn
// one batch moves a sink's share 30x near 1e-4, and a clean step takes
// another from 0.08 to 0.26. They are not judged; what they do to the
// stream is, at attn.context, attn.out and the expert sites after them.
bool probability_site(SiteId id) {
  return id == SiteId::kAttnProbs || id == SiteId::kAttnSink || id == SiteId::kMlpRouterProbs;
}

// A series' values as logged, one per step (none where not logged).
std::vector<std::optional<double>> logged_series(const std::vector<StepState>& states, bool loss) {
  std::vector<std::optional<double>> series;
  for (const StepState& s : states) series.push_back(loss ? s.logged.loss : s.logged.grad_norm);
  return series;
}

// The first index whose value spikes against the values before it.
std::optional<std::pair<size_t, TrajectoryDeviation>> first_series_spike(
    const std::vector<std::optional<double>>& series, double ratio, const SpikeThresholds& t) {
  std::vector<double> before;
  for (size_t i = 0; i < series.size(); ++i) {
    if (!series[i]) continue;
    const std::optional<TrajectoryDeviation> d = deviation_from_trajectory(before, *series[i], t);
    if (d && d->score >= t.zscore && d->ratio >= ratio) return std::make_pair(i, *d);
    before.push_back(*series[i]);
  }
  return std::nullopt;
}

bool logs_nonfinite(const std::vector<StepState>& states) {
  for (const StepState& s : states) {
    if (s.logged.loss && !std::isfinite(*s.logged.loss)) return true;
    if (s.logged.grad_norm && !std::isfinite(*s.logged.grad_norm)) return true;
  }
  return false;
}

// A whole site's record, or one of its heads or experts: the more specific
// one names more.
bool more_specific(const ProbeRecord& a, const ProbeRecord& b) { return !is_whole(a) && is_whole(b); }

}  // namespace

std::optional<TrajectoryDeviation> deviation_from_trajectory(const std::vector<double>& before, double value,
                                                             const SpikeThresholds& t) {
  if (!usable_magnitude(value)) return std::nullopt;
  std::vector<double> logs;
  for (double v : before) {
    if (usable_magnitude(v)) logs.push_back(std::log(v));
  }
  if (logs.size() < static_cast<size_t>(t.min_history) + 1) return std::nullopt;
  std::vector<double> changes;
  for (size_t i = 1; i < logs.size(); ++i) changes.push_back(logs[i] - logs[i - 1]);
  const double trend = median_of(changes);
  const double scale = std::max(robust_sigma(changes, trend), t.min_log_scale);
  const double beyond = std::log(value) - logs.back() - trend;
  // Above its trend and above the step before: a decline that slows down is
  // beyond its trend without rising, and a steady climb rises on its trend.
  const double over_previous = std::log(value) - logs.back();
  return TrajectoryDeviation{beyond / scale, std::exp(std::min(beyond, over_previous))};
}

SpikePlan plan_spike(const std::optional<IncidentInfo>& incident, const std::vector<StepState>& logged,
                     const SpikeOverrides& overrides) {
  SpikePlan plan;
  plan.thresholds = with_overrides(incident && incident->spike ? *incident->spike : SpikeThresholds{}, overrides);
  // What the incident is declared to be: the flag, else the manifest; neither says: undeclared.
  const bool flagged = overrides.spike.has_value();
  const bool declared_spike = flagged ? *overrides.spike : (incident && incident->kind == IncidentKind::kSpike);
  const bool declared_other =
      flagged ? !*overrides.spike : (incident && incident->kind && *incident->kind != IncidentKind::kSpike);
  const SpikeThresholds& t = plan.thresholds;
  auto loss = first_series_spike(logged_series(logged, true), t.loss_ratio, t);
  auto norm = first_series_spike(logged_series(logged, false), t.grad_norm_ratio, t);
  const bool norm_first = norm && (!loss || norm->first < loss->first);
  const auto& first = norm_first ? norm : loss;
  if (first) {
    plan.step = logged[first->first].step;
    plan.quantity = norm_first ? "grad_norm" : "loss";
    plan.logged_ratio = first->second.ratio;
  }
  plan.declared = declared_spike;
  plan.active = declared_spike || (!declared_other && first && !logs_nonfinite(logged));
  if (plan.declared && incident && incident->step) plan.step = *incident->step;
  return plan;
}

void SpikeLocator::step_done(int64_t step, const std::vector<ProbeRecord>& records, std::optional<int64_t> last_step) {
  if (origin_ || (last_step && step > *last_step)) return;
  origin_ = judge(step, records);
  remember(records);
}

std::optional<SpikeOrigin> SpikeLocator::judge(int64_t step, const std::vector<ProbeRecord>& records) const {
  const ProbeRecord* best = nullptr;
  SpikeOrigin found;
  for (const ProbeRecord& r : records) {
    if (r.phase != Phase::kForward || probability_site(r.site.id)) continue;
    const auto seen = history_.find(Key{static_cast<int>(r.site.id), r.layer, r.head, r.expert});
    if (seen == history_.end()) continue;
    for (const char* statistic : {"max_abs", "rms"}) {
      const bool max_abs = statistic[0] == 'm';
      std::vector<double> before;
      for (const Point& p : seen->second) before.push_back(max_abs ? p.max_abs : p.rms);
      const double value = max_abs ? r.stats.max_abs : r.stats.rms();
      const auto d = deviation_from_trajectory(before, value, thresholds_);
      if (!d || d->score < thresholds_.site_zscore || d->ratio < thresholds_.site_ratio) continue;
      // Earliest in execution order; at one place, a head or expert over the
      // whole, then the larger score.
      const bool earlier = best == nullptr || execution_key(r) < execution_key(*best);
      const bool same_place = best != nullptr && execution_key(r) == execution_key(*best) && r.site == best->site;
      const bool better_here = same_place && (more_specific(r, *best) ||
                                              (is_whole(r) == is_whole(*best) && d->score > found.score));
      if (!earlier && !better_here) continue;
      best = &r;
      found = SpikeOrigin{step, r.phase, r.site, r.layer, r.head, r.expert, r.rank, r.micro_batch,
                          r.largest_sample, r.largest_position, statistic, d->score, d->ratio, r.damage};
    }
  }
  if (best == nullptr) return std::nullopt;
  return found;
}

void SpikeLocator::remember(const std::vector<ProbeRecord>& records) {
  // Each key's step value: the largest max |x| and the pooled rms over every micro-batch and rank.
  std::map<Key, std::pair<double, std::pair<double, int64_t>>> step_values;
  for (const ProbeRecord& r : records) {
    if (r.phase != Phase::kForward || !r.stats.all_finite()) continue;
    auto& v = step_values[Key{static_cast<int>(r.site.id), r.layer, r.head, r.expert}];
    v.first = std::max(v.first, r.stats.max_abs);
    v.second.first += r.stats.sum_sq;
    v.second.second += r.stats.finite_count;
  }
  for (const auto& [key, v] : step_values) {
    std::vector<Point>& points = history_[key];
    const double rms = v.second.second > 0 ? std::sqrt(v.second.first / double(v.second.second)) : 0.0;
    points.push_back(Point{v.first, rms});
    if (points.size() > kSpikeHistorySteps) points.erase(points.begin());
  }
}

namespace {

// The replayed series of one quantity up to `step` (exclusive) and its value there.
std::optional<TrajectoryDeviation> replayed_deviation(const std::vector<StepOutcome>& steps, int64_t step, bool loss,
                                                      const SpikeThresholds& t) {
  std::vector<double> before;
  for (const StepOutcome& s : steps) {
    if (!s.replayed) continue;
    const double value = loss ? s.loss : s.grad_norm;
    if (s.step == step) return deviation_from_trajectory(before, value, t);
    if (s.step < step) before.push_back(value);
  }
  return std::nullopt;
}

}  // namespace

std::string logit_growth_clause(const std::optional<LogitGrowthMechanism>& m) {
  if (!m) return "";
  return "; the mechanism is attention-logit growth: the head's largest query-key logit grew " +
         format_number(m->healthy_growth) + "x over the healthy steps before, then " + format_number(m->spike_jump) +
         "x into the spike";
}

void name_spike_as_cause(ReplayReport& report) {
  if (!report.spike || !report.spike->origin || report.first_nonfinite) return;
  if (report.root_cause && report.root_cause->code) return;
  const SpikeOrigin& o = *report.spike->origin;
  std::string where = o.name();
  if (o.head >= 0) where += " head " + std::to_string(o.head);
  if (o.expert >= 0) where += " expert " + std::to_string(o.expert);
  if (o.sample >= 0) where += ", sample " + std::to_string(o.sample) + " position " + std::to_string(o.position);
  report.root_cause = RootCause{TriageLayer::kNumeric, std::nullopt,
                                "a " + std::string(report.spike->quantity == "grad_norm" ? "gradient-norm" : "loss") +
                                    " spike that stays finite at step " + std::to_string(*report.spike->step) +
                                    ": it starts at step " + std::to_string(o.step) + ", " + where + ", whose " +
                                    o.statistic + " is " + format_number(o.ratio) + "x its trend" +
                                    logit_growth_clause(report.spike->mechanism)};
}

std::optional<SpikeReport> judge_spike(const SpikePlan& plan, const std::vector<StepOutcome>& steps,
                                       const std::optional<SpikeOrigin>& origin) {
  if (!plan.active) return std::nullopt;
  const SpikeThresholds& t = plan.thresholds;
  SpikeReport report;
  report.declared = plan.declared;
  report.step = plan.step;
  report.quantity = plan.quantity;
  report.logged_ratio = plan.logged_ratio;
  if (origin && (!plan.step || origin->step <= *plan.step)) report.first_departure = origin;
  if (!report.step) {  // declared without a step and nothing in the log: the replay's own first spike
    std::vector<std::optional<double>> losses;
    for (const StepOutcome& s : steps) losses.push_back(s.replayed ? std::optional(s.loss) : std::nullopt);
    if (auto first = first_series_spike(losses, t.loss_ratio, t)) {
      report.step = steps[first->first].step;
      report.quantity = "loss";
    }
  }
  if (!report.step) {
    report.not_reproduced_reason = "neither the log nor the replay spikes anywhere in the window";
    return report;
  }
  for (const char* quantity : {"loss", "grad_norm"}) {
    if (!report.quantity.empty() && report.quantity != quantity) continue;
    const bool loss = std::string(quantity) == "loss";
    const auto d = replayed_deviation(steps, *report.step, loss, t);
    if (!d) continue;
    const bool spikes = d->score >= t.zscore && d->ratio >= (loss ? t.loss_ratio : t.grad_norm_ratio);
    if (!report.replayed_ratio || spikes) report.replayed_ratio = d->ratio;
    if (spikes) {
      report.reproduced = true;
      report.quantity = quantity;
      break;
    }
  }
  if (!report.reproduced) {
    const std::string at = "step " + std::to_string(*report.step);
    if (!report.replayed_ratio) {
      report.not_reproduced_reason = at + " was not replayed finite with enough healthy steps before it";
    } else if (!plan.logged_ratio) {
      report.not_reproduced_reason = "neither the logged nor the replayed loss or gradient norm of " + at +
                                     " leaves its trajectory: the declared spike is not in the window's numbers";
    } else {
      report.not_reproduced_reason = "the replayed " + std::string(report.quantity == "grad_norm" ? "gradient norm" : "loss") +
                                     " of " + at + " stays on its trajectory (" + format_number(*report.replayed_ratio) +
                                     "x) where the logged one spikes (" + format_number(*plan.logged_ratio) + "x)";
    }
    return report;
  }
  if (origin && origin->step <= *report.step) report.origin = origin;
  return report;
}

}  // namespace nanreplay
