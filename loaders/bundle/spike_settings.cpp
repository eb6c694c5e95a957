// incident.spike read key by key; see spike_settings.h.
#include "loaders/bundle/spike_settings.h"

#include <cmath>

#include "loaders/base/error.h"
#include "loaders/base/json_util.h"

namespace nanreplay {

const char* incident_kind_name(IncidentKind kind) {
  return kind == IncidentKind::kSpike ? "spike" : "nonfinite";
}

namespace {

std::string spike_value_text(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return nlohmann::json(value).dump();
}

// A threshold that must exceed `floor`: anything at or below it would call
// every step a spike.
double spike_threshold(const JsonReader& spike, const std::string& key, double fallback, double floor) {
  const std::optional<double> value = spike.optional_number(key);
  if (!value) return fallback;
  if (!(std::isfinite(*value) && *value > floor)) {
    throw InputError(spike.file(), spike.key_path(key),
                     "expected a finite number above " + nlohmann::json(floor).dump() + ", got " + spike_value_text(*value));
  }
  return *value;
}

}  // namespace

SpikeThresholds with_overrides(SpikeThresholds t, const SpikeOverrides& o) {
  t.loss_ratio = o.loss_ratio.value_or(t.loss_ratio);
  t.grad_norm_ratio = o.grad_norm_ratio.value_or(t.grad_norm_ratio);
  t.zscore = o.zscore.value_or(t.zscore);
  t.site_zscore = o.site_zscore.value_or(t.site_zscore);
  t.site_ratio = o.site_ratio.value_or(t.site_ratio);
  return t;
}

nlohmann::json spike_thresholds_json(const SpikeThresholds& t) {
  return {{"loss_ratio", t.loss_ratio},       {"grad_norm_ratio", t.grad_norm_ratio},
          {"zscore", t.zscore},               {"site_zscore", t.site_zscore},
          {"site_ratio", t.site_ratio},       {"min_log_scale", t.min_log_scale},
          {"min_history", t.min_history}};
}

SpikeThresholds parse_spike_thresholds(const JsonReader& spike) {
  SpikeThresholds t;
  t.loss_ratio = spike_threshold(spike, "loss_ratio", t.loss_ratio, 1.0);
  t.grad_norm_ratio = spike_threshold(spike, "grad_norm_ratio", t.grad_norm_ratio, 1.0);
  t.zscore = spike_threshold(spike, "zscore", t.zscore, 0.0);
  t.site_zscore = spike_threshold(spike, "site_zscore", t.site_zscore, 0.0);
  t.site_ratio = spike_threshold(spike, "site_ratio", t.site_ratio, 1.0);
  t.min_log_scale = spike_threshold(spike, "min_log_scale", t.min_log_scale, 0.0);
  if (spike.has("min_history")) {
    const int64_t history = spike.integer("min_history");
    if (history < 1 || history > 1000) {
      throw InputError(spike.file(), spike.key_path("min_history"),
                       "expected an integer in [1, 1000], got " + std::to_string(history));
    }
    t.min_history = static_cast<int>(history);
  }
  return t;
}

}  // namespace nanreplay
