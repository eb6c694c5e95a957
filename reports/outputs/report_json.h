// report.json: a replay report as the stable JSON object of report-v1 (keys
// this project adds: docs/report-format.md), and the pieces of it that
// `bisect --json` shares.
#pragma once

#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/report.h"

namespace nanreplay {

nlohmann::json report_to_json(const ReplayReport& report);
// report.json's `findings` array, in the order given.
nlohmann::json findings_json(const std::vector<Finding>& findings);
// report.json's `first_nonfinite` object (null when absent).
nlohmann::json first_nonfinite_json(const std::optional<FirstNonfinite>& first);
nlohmann::json what_if_json(const std::vector<WhatIfOutcome>& outcomes);
nlohmann::json origin_tokens_json(const std::vector<OriginToken>& tokens);

}  // namespace nanreplay
