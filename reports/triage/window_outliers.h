// "What changed" over a spike incident's window (docs/spikes.md): while the
// window replays, OutlierTracker keeps per step each head's largest
// query-key logit (the attn.scores site's per-head max |x|) and each expert's
// largest activation (mlp.expert.act, mlp.expert.down), read from the probe
// records the replay takes anyway, and its largest router logit (one amax
// of the router's logits per layer, replay/arch/router_logit_max.h). After
// it, summary() ranks them and logit_growth() says whether attention-logit
// growth is the spike's mechanism.
// Memory: one number per head and three per expert per step, at most
// kSpikeHistorySteps steps.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "probes/probe_record.h"
#include "reports/results/spike.h"
#include "reports/results/window_outliers.h"

namespace nanreplay {

// How many heads and experts report.json lists (the largest at the spike's step).
constexpr size_t kOutlierHeadsListed = 3;
constexpr size_t kOutlierExpertsListed = 3;
// Attention-logit growth is the mechanism when the origin is a head's
// attn.scores and that head's largest logit grew at least this many times
// over the healthy steps (docs/spikes.md says how it was calibrated).
constexpr double kLogitGrowthHealthyFactor = 2.0;

class OutlierTracker {
 public:
  // One replayed step's records and its [layer][expert] largest router
  // logits (empty for a dense model). Steps after `last_step` are not kept.
  void step_done(int64_t step, const std::vector<ProbeRecord>& records,
                 const std::vector<std::vector<double>>& router_logit_max, std::optional<int64_t> last_step);
  // The kept steps up to `spike_step` (all of them when none).
  WindowOutliers summary(std::optional<int64_t> spike_step) const;
  // Attention-logit growth, where the origin is a head's attn.scores whose
  // largest logit grew kLogitGrowthHealthyFactor times over the steps before it.
  std::optional<LogitGrowthMechanism> logit_growth(const SpikeOrigin& origin) const;

 private:
  using Key = std::pair<int, int>;  // layer, head (or expert)
  struct StepMaxima {
    int64_t step = 0;
    std::map<Key, double> head_logit, expert_act, expert_down, router_logit;
  };
  // The kept steps up to `spike_step`.
  std::vector<const StepMaxima*> steps_until(std::optional<int64_t> spike_step) const;

  std::vector<StepMaxima> steps_;  // in step order, the last kSpikeHistorySteps
};

}  // namespace nanreplay
