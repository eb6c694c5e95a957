// A spike's counterfactual replays (docs/spikes.md, "Data or model state"):
// after the window, the spike step's batch on the previous step's weights
// and the previous step's batch on the spike step's weights, each one more
// replay_step (probes on only when the spike names a site whose statistic
// is compared). While the window replays, this keeps what the two steps need
// later: state, batch, derived weights (a rolled-forward step has no file),
// and a few numbers per forward site; never their records.
#pragma once

#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/gradients.h"
#include "reports/results/counterfactual.h"
#include "reports/results/report.h"

namespace nanreplay {

class SpikeCounterfactuals {
 public:
  explicit SpikeCounterfactuals(int64_t spike_step) : step_(spike_step) {}
  bool wants(int64_t step) const { return step == step_ || step == step_ - 1; }
  // A replayed step of the two: `derived` holds its weights when it has no checkpoint file.
  void keep(const StepFiles& files, const StepState& state, const StepBatch& batch,
            const std::vector<ProbeRecord>& records, std::optional<ModelCheckpoint> derived);
  // None unless both steps were replayed and the spike was judged.
  std::optional<Counterfactuals> run(const Bundle& bundle, const SpikeReport& spike,
                                     const std::vector<StepOutcome>& steps, const std::vector<Finding>& findings,
                                     bool update_checked, const ComputePlacement& placement);

 private:
  using SiteKey = std::tuple<int, int, int, int>;  // site id, layer, head, expert
  struct SitePoint {
    double max_abs = 0.0, sum_sq = 0.0;
    int64_t count = 0;
  };
  struct Kept {
    const StepFiles* files = nullptr;
    StepState state;
    StepBatch batch;
    std::optional<ModelCheckpoint> derived;
    std::map<SiteKey, SitePoint> sites;
  };
  int64_t step_;
  std::map<int64_t, Kept> kept_;
};

}  // namespace nanreplay
