// `nanreplay trace`: select probe rows of a trace.h5 in the terminal by step,
// phase, site glob, head and expert; sort by max|x| or keep only non-finite rows in
// execution order. Pure: filtering and rendering, no file access.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "probes/probe_record.h"

namespace nanreplay {

struct TraceQuery {
  std::optional<int64_t> step;
  std::optional<Phase> phase;
  std::string site_pattern;  // glob ('*' any run, '?' one character); empty matches all
  std::optional<int> head;
  std::optional<int> expert;  // -1: rows not of one expert
  bool sort_by_max_abs = false;  // descending
  bool only_nonfinite = false;   // NaN/Inf rows in execution order
  size_t limit = 50;
};

struct TraceSelection {
  std::vector<ProbeRecord> rows;  // at most limit
  size_t matched = 0;             // before the limit
};

// "forward", "backward" or "grad"; nullopt otherwise.
std::optional<Phase> parse_phase(const std::string& name);

TraceSelection select_probes(const std::vector<ProbeRecord>& probes, const TraceQuery& query);
std::string render_trace_table(const TraceSelection& selection);
nlohmann::json trace_selection_json(const TraceSelection& selection);

}  // namespace nanreplay
