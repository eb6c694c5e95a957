// The renderings of a BisectReport: the stable JSON object for runbooks
// (schema in docs/bisect-and-what-if.md, versioned by "bisect_version") and
// the terminal text.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "reports/outputs/terminal_text.h"
#include "reports/results/bisect_report.h"

namespace nanreplay {

nlohmann::json bisect_to_json(const BisectReport& report);
std::string render_bisect(const BisectReport& report, const TextStyle& style);

}  // namespace nanreplay
