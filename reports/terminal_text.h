// The short verdict a person reads in the terminal after `nanreplay run`:
// reproduced or not, the first non-finite tensor, the step table of replayed
// against logged loss, and the findings. Plain text; ANSI colour only when asked.
#pragma once

#include <string>

#include "reports/number_text.h"
#include "reports/report.h"

namespace nanreplay {

struct TextStyle {
  bool color = false;
};

std::string render_verdict(const ReplayReport& report, const TextStyle& style);

// The what-if block (`run --what-if` and `bisect --what-if`): one entry per what-if.
std::string render_what_ifs(const std::vector<WhatIfOutcome>& outcomes, const TextStyle& style);


}  // namespace nanreplay
