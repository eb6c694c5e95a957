// The short verdict a person reads in the terminal after `nanreplay run`:
// reproduced or not, the first non-finite tensor, the step table of replayed
// against logged loss, and the findings. Plain text; ANSI colour only when asked.
#pragma once

#include <string>
#include <utility>

#include "reports/results/number_text.h"
#include "reports/results/report.h"

namespace nanreplay {

struct TextStyle;

// `text` in SGR `code` ("1;31") when the style has color, else as it is.
std::string paint(const TextStyle& style, const char* code, const std::string& text);
// `text` padded with spaces to `width` columns.
std::string pad(const std::string& text, size_t width);

struct TextStyle {
  TextStyle(bool color_text = false, std::string results_dir = {})
      : color(color_text), out_dir(std::move(results_dir)) {}
  bool color = false;
  // Where `run` wrote its results, for the commands of the Next: line
  // ("OUT" when the caller does not say).
  std::string out_dir;
};

std::string render_verdict(const ReplayReport& report, const TextStyle& style);

// The what-if block (`run --what-if` and `bisect --what-if`): one entry per what-if.
std::string render_what_ifs(const std::vector<WhatIfOutcome>& outcomes, const TextStyle& style);


}  // namespace nanreplay
