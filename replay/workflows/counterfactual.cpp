// See counterfactual.h. Each counterfactual is one replay_step with another
// step's batch and state on these weights: the same path as every replay.
#include "replay/workflows/counterfactual.h"

#include <cmath>

#include "replay/step/step.h"
#include "reports/triage/spike_counterfactual.h"

namespace nanreplay {

namespace {

using CounterfactualKey = std::tuple<int, int, int, int>;

CounterfactualKey counterfactual_key(const ProbeRecord& r) {
  return {static_cast<int>(r.site.id), r.layer, r.head, r.expert};
}

double counterfactual_statistic(double max_abs, double sum_sq, int64_t count, const std::string& statistic) {
  if (statistic == "rms") return count > 0 ? std::sqrt(sum_sq / double(count)) : NAN;
  return max_abs;
}

}  // namespace

void SpikeCounterfactuals::keep(const StepFiles& files, const StepState& state, const StepBatch& batch,
                                const std::vector<ProbeRecord>& records, std::optional<ModelCheckpoint> derived) {
  Kept kept{&files, state, batch, std::move(derived), {}};
  for (const ProbeRecord& r : records) {
    if (r.phase != Phase::kForward) continue;
    SitePoint& p = kept.sites[counterfactual_key(r)];
    p.max_abs = std::max(p.max_abs, r.stats.max_abs);
    p.sum_sq += r.stats.sum_sq;
    p.count += r.stats.finite_count;
  }
  kept_.erase(files.step);
  kept_.emplace(files.step, std::move(kept));
}

std::optional<Counterfactuals> SpikeCounterfactuals::run(const Bundle& bundle, const SpikeReport& spike,
                                                         const std::vector<StepOutcome>& steps,
                                                         const std::vector<Finding>& findings, bool update_checked,
                                                         const ComputePlacement& placement) {
  const auto now = kept_.find(step_), before = kept_.find(step_ - 1);
  if (now == kept_.end() || before == kept_.end()) return std::nullopt;
  Counterfactuals c;
  c.step = step_;
  c.previous_step = step_ - 1;
  for (const StepOutcome& s : steps) {
    if (!s.replayed) continue;
    if (s.step == c.step) c.loss.spike = s.loss, c.logged_loss = s.logged_loss;
    if (s.step == c.previous_step) c.loss.previous = s.loss, c.logged_previous_loss = s.logged_loss;
  }
  // The site compared: the spike's origin, else its first departure.
  const std::optional<SpikeOrigin>& site = spike.reproduced && spike.origin ? spike.origin : spike.first_departure;
  StepRequest request;
  request.probes = site ? ProbeLevel::kFull : ProbeLevel::kOff;
  const Manifest& m = bundle.manifest();
  auto weights_of = [&](Kept& k) -> ModelCheckpoint {
    return k.derived ? k.derived->share() : ModelCheckpoint(*k.files, m.model);
  };
  auto replay = [&](Kept& data, Kept& weights) {
    ModelCheckpoint checkpoint = weights_of(weights);
    return replay_step({m, bundle.tokens(), data.files->step, data.state, data.batch}, checkpoint, placement, request);
  };
  const StepResult on_previous = replay(now->second, before->second);
  const StepResult on_spike = replay(before->second, now->second);
  c.loss.spike_batch_previous_weights = on_previous.loss;
  c.loss.previous_batch_spike_weights = on_spike.loss;
  if (site) {
    c.site = site->name();
    c.head = site->head;
    c.expert = site->expert;
    c.statistic = site->statistic;
    const CounterfactualKey key{static_cast<int>(site->site.id), site->layer, site->head, site->expert};
    auto value_in = [&](const std::vector<ProbeRecord>& records) {
      SitePoint p;
      for (const ProbeRecord& r : records) {
        if (r.phase != Phase::kForward || counterfactual_key(r) != key) continue;
        p.max_abs = std::max(p.max_abs, r.stats.max_abs);
        p.sum_sq += r.stats.sum_sq;
        p.count += r.stats.finite_count;
      }
      return counterfactual_statistic(p.max_abs, p.sum_sq, p.count, c.statistic);
    };
    auto kept_value = [&](const Kept& k) {
      const auto found = k.sites.find(key);
      if (found == k.sites.end()) return double(NAN);
      return counterfactual_statistic(found->second.max_abs, found->second.sum_sq, found->second.count, c.statistic);
    };
    c.site_values = CounterfactualValues{kept_value(before->second), kept_value(now->second), value_in(on_previous.probes),
                                         value_in(on_spike.probes)};
  }
  conclude_counterfactuals(c, findings, update_checked);
  return c;
}

}  // namespace nanreplay
