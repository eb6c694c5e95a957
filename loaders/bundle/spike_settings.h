// A spike incident's thresholds (docs/spikes.md): how far a logged or
// replayed loss or gradient norm, and a site's statistic, must leave its own
// trajectory over the steps before it to count as a spike. Read from the
// manifest's optional `incident.spike` object and from `run`'s --spike-*
// flags; the defaults are calibrated on the clean presets (docs/spikes.md).
#pragma once

#include <optional>

#include <nlohmann/json.hpp>


namespace nanreplay {

struct SpikeThresholds {
  // Every series is judged by its step-to-step change in log space against
  // the changes before it (its trend): a loss spikes when it is at least
  // `loss_ratio` times what its trend predicts and `zscore` robust standard
  // deviations (median / MAD) of the earlier changes above it; a gradient
  // norm likewise with `grad_norm_ratio`.
  double loss_ratio = 1.5;
  double grad_norm_ratio = 4.0;
  double zscore = 6.0;
  // A site's max |x| or rms leaves its trajectory at this robust z-score of
  // its log change and at least `site_ratio` times its trend and the step before.
  double site_zscore = 6.0;
  double site_ratio = 3.0;
  // The robust scale never falls below this (log units): a short, smooth
  // history has a median absolute deviation near zero.
  double min_log_scale = 0.05;
  // Earlier changes needed before a step can be judged (1: two steps before it).
  int min_history = 1;
};

// `run`'s --spike-* flags and --incident-kind: each, where given, replaces
// the manifest's value.
struct SpikeOverrides {
  std::optional<double> loss_ratio, grad_norm_ratio, zscore, site_zscore, site_ratio;
  std::optional<bool> spike;  // --incident-kind: true "spike", false "nonfinite"
  bool any() const { return loss_ratio || grad_norm_ratio || zscore || site_zscore || site_ratio || spike; }
};
SpikeThresholds with_overrides(SpikeThresholds t, const SpikeOverrides& o);

enum class IncidentKind { kNonfinite, kSpike };
const char* incident_kind_name(IncidentKind kind);  // "nonfinite", "spike"

class JsonReader;
// `incident.spike` (every key optional): loss_ratio, grad_norm_ratio, zscore,
// site_zscore, site_ratio (each > 1, finite), min_log_scale (> 0),
// min_history (>= 1). A bad value throws InputError naming the key.
SpikeThresholds parse_spike_thresholds(const JsonReader& spike);
// The same object back, every key written (manifest_writer.h).
nlohmann::json spike_thresholds_json(const SpikeThresholds& t);

}  // namespace nanreplay
