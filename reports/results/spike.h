// A spike incident's outcome (docs/spikes.md): whether the replay spikes
// where the log does, and where the spike starts. Plain data; triage fills
// it (reports/triage/spike_origin.h), the renderers show it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "probes/probe_record.h"
#include "reports/results/window_outliers.h"

namespace nanreplay {

// The first site whose statistic leaves its own trajectory.
struct SpikeOrigin {
  int64_t step = 0;
  Phase phase = Phase::kForward;
  SiteRef site;
  int layer = -1, head = -1, expert = -1, rank = -1, micro_batch = -1;
  int64_t sample = -1, position = -1;  // the element of largest |x| of that record
  std::string statistic;               // "max_abs" or "rms"
  double score = 0.0;                  // robust z of its log increment
  double ratio = 0.0;                  // how many times beyond its trend
  // Where that record's outlying elements lie (probes/damage_shape.h); null: not taken.
  std::shared_ptr<const DamageShape> damage;

  std::string name() const { return probe_name(phase, site, ""); }
};

struct SpikeReport {
  bool reproduced = false;
  bool declared = false;      // the manifest said "kind": "spike"; else found in the log
  std::optional<int64_t> step;  // the spike's step (incident.step, or the log's first spike)
  std::string quantity;       // "loss" or "grad_norm": what spikes
  std::optional<double> logged_ratio, replayed_ratio;  // times beyond the trend at `step`
  std::string not_reproduced_reason;  // for people, when !reproduced
  std::optional<SpikeOrigin> origin;  // only when reproduced
  // The first record that left its trajectory up to the spike's step, reproduced or not.
  std::optional<SpikeOrigin> first_departure;
  // Attention-logit growth, when the origin is a head's scores that grew
  // over the healthy steps (reports/triage/window_outliers.h).
  std::optional<LogitGrowthMechanism> mechanism;
};

}  // namespace nanreplay
