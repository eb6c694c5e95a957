// A spike's counterfactual replays as every renderer shows them
// (docs/report-format.md, "counterfactuals"): report.json's optional object,
// and the same few lines for the terminal, report.md and report.html.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/counterfactual.h"

namespace nanreplay {

// Null without one.
nlohmann::json counterfactuals_json(const std::optional<Counterfactuals>& c);
// "Counterfactuals: data: ...", then the four losses, the site's values, the update; empty without one.
std::vector<std::string> counterfactual_lines(const std::optional<Counterfactuals>& c);

}  // namespace nanreplay
