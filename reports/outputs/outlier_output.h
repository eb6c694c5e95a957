// What changed over a spike incident's window as every renderer shows it
// (docs/spikes.md, "What changed"): report.json's optional
// `head_logit_growth` and `expert_outliers`, and a line or two for the
// terminal, report.md and report.html.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/window_outliers.h"

namespace nanreplay {

// Null without a spike incident's summary (or without a head in it).
nlohmann::json head_logit_growth_json(const std::optional<WindowOutliers>& w);
// Null without a spike incident's summary or for a dense model.
nlohmann::json expert_outliers_json(const std::optional<WindowOutliers>& w);
// spike_check.mechanism: null without one.
nlohmann::json mechanism_json(const std::optional<LogitGrowthMechanism>& m);
// "Largest query-key logit: layers.1 head 2 0.5, 1.2, 2.8, 25 (steps 100-103) ...",
// and the same for the top expert; empty without a summary.
std::vector<std::string> window_outlier_lines(const std::optional<WindowOutliers>& w);

}  // namespace nanreplay
