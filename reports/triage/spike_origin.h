// A spike incident (docs/spikes.md): a loss or gradient-norm spike that
// never goes non-finite. Before the replay, plan_spike reads the logged
// series (is this a spike incident, at which step); during it, SpikeLocator
// follows every forward site's max |x| and rms step by step and keeps the
// first record that leaves its own trajectory; after it, judge_spike says
// whether the replay spikes where the log does and names the origin.
// Memory: two numbers per site (and head, expert) per step, at most
// kSpikeHistorySteps steps.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/step_state.h"
#include "reports/results/report.h"

namespace nanreplay {

// How far one value leaves the trajectory of the values before it: its log
// change from the last one, against the median and MAD of the earlier log
// changes (the trend), in robust standard deviations (`score`), and as a
// factor (`ratio`): the smaller of how far it lies above its trend and above
// the value before it.
struct TrajectoryDeviation {
  double score = 0.0;
  double ratio = 1.0;
};
// None when fewer than thresholds.min_history + 1 earlier values are positive
// and finite, or `value` is not.
std::optional<TrajectoryDeviation> deviation_from_trajectory(const std::vector<double>& before, double value,
                                                             const SpikeThresholds& thresholds);

struct SpikePlan {
  bool active = false;    // a spike incident: locate, judge, report
  bool declared = false;  // incident.kind "spike" (or --incident-kind spike)
  std::optional<int64_t> step;  // incident.step, else the log's first spike
  std::string quantity;         // "loss" / "grad_norm" of the log's spike; empty: none logged
  std::optional<double> logged_ratio;
  SpikeThresholds thresholds;
};
// `logged`: the window's states in step order.
SpikePlan plan_spike(const std::optional<IncidentInfo>& incident, const std::vector<StepState>& logged,
                     const SpikeOverrides& overrides);

constexpr size_t kSpikeHistorySteps = 64;

class SpikeLocator {
 public:
  explicit SpikeLocator(const SpikeThresholds& thresholds) : thresholds_(thresholds) {}
  // One replayed step's records (forward ones are read). Steps after the
  // first origin found, or after `last_step`, are not judged.
  void step_done(int64_t step, const std::vector<ProbeRecord>& records, std::optional<int64_t> last_step);
  const std::optional<SpikeOrigin>& origin() const { return origin_; }

 private:
  using Key = std::tuple<int, int, int, int>;  // site id, layer, head, expert
  struct Point {
    double max_abs = 0.0, rms = 0.0;
  };
  std::optional<SpikeOrigin> judge(int64_t step, const std::vector<ProbeRecord>& records) const;
  void remember(const std::vector<ProbeRecord>& records);

  SpikeThresholds thresholds_;
  std::map<Key, std::vector<Point>> history_;
  std::optional<SpikeOrigin> origin_;
};

// A spike origin with no finding to rest a cause on: the root cause names
// the spike's origin instead of "no fault found" (its code stays NONE).
void name_spike_as_cause(ReplayReport& report);
// "; the mechanism is attention-logit growth: ..." for a sentence that names
// the origin; empty without a mechanism.
std::string logit_growth_clause(const std::optional<LogitGrowthMechanism>& mechanism);

// After the replay: the spike report of an active plan (none otherwise).
std::optional<SpikeReport> judge_spike(const SpikePlan& plan, const std::vector<StepOutcome>& steps,
                                       const std::optional<SpikeOrigin>& origin);

}  // namespace nanreplay
