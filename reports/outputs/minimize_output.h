// The renderings of a MinimizeReport: the stable JSON object (schema in
// docs/minimize.md, versioned by "minimize_version") and the terminal text.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "reports/outputs/terminal_text.h"
#include "reports/results/minimize_report.h"

namespace nanreplay {

nlohmann::json minimize_to_json(const MinimizeReport& report);
std::string render_minimize(const MinimizeReport& report, const TextStyle& style);

}  // namespace nanreplay
