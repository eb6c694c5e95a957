// `nanreplay trace`: select probe rows of a trace.h5 in the terminal by step,
// phase, site glob, head and expert; sort by max|x| or keep only non-finite rows in
// execution order, or name the origins: the first non-finite sites, each as its
// own head's or expert's row. Pure: filtering and rendering, no file access.
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
  // With only_nonfinite: one row per non-finite site in execution order, the
  // row of the head or expert holding the site's first non-finite element
  // when the trace has it (what the report names), else the whole row.
  bool origin_rows = false;
  size_t limit = 50;
};

struct TraceSelection {
  std::vector<ProbeRecord> rows;  // at most limit
  size_t matched = 0;             // before the limit
  std::vector<int64_t> trace_steps;  // every step the trace holds, ascending: for "no row matched"
};

// "100-103, 105": steps as ranges, for messages.
std::string describe_steps(const std::vector<int64_t>& ascending_steps);
// The steps a trace's probes cover, ascending and distinct.
std::vector<int64_t> steps_in(const std::vector<ProbeRecord>& probes);

// "forward", "backward" or "grad"; nullopt otherwise.
std::optional<Phase> parse_phase(const std::string& name);

TraceSelection select_probes(const std::vector<ProbeRecord>& probes, const TraceQuery& query);
std::string render_trace_table(const TraceSelection& selection);
nlohmann::json trace_selection_json(const TraceSelection& selection);

}  // namespace nanreplay
