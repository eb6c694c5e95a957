// Trace queries for `nanreplay trace`: filter, order, limit, render as a
// fixed-width table or JSON. Rows come from read_trace.
#include "reports/outputs/trace_query.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>
#include <sstream>

#include "loaders/base/error.h"
#include "loaders/base/glob_match.h"
#include "reports/results/report.h"
#include "reports/outputs/terminal_text.h"

namespace nanreplay {

std::optional<Phase> parse_phase(const std::string& name) {
  for (Phase phase : {Phase::kForward, Phase::kBackward, Phase::kGrad}) {
    if (name == phase_name(phase)) return phase;
  }
  return std::nullopt;
}

namespace {

bool passes_filters(const ProbeRecord& r, const TraceQuery& query) {
  if (query.step && r.step != *query.step) return false;
  if (query.phase && r.phase != *query.phase) return false;
  if (query.head && r.head != *query.head) return false;
  if (query.expert && r.expert != *query.expert) return false;
  if (!query.site_pattern.empty() && !glob_match(query.site_pattern, probe_name(r))) return false;
  return !query.only_nonfinite || !r.stats.all_finite();
}

// One site at one point of the replay, and which part of it (head, expert).
using PartKey = std::tuple<int64_t, int, int, int, std::string, int, int>;
PartKey part_key(const ProbeRecord& r, int head, int expert) {
  return {r.step, r.micro_batch, r.rank, static_cast<int>(r.phase), probe_name(r), head, expert};
}

// The whole non-finite rows, each swapped for the row of the head or expert
// that holds its first non-finite element when the trace has that row.
std::vector<ProbeRecord> origin_rows(const std::vector<ProbeRecord>& probes, const TraceQuery& query) {
  std::map<PartKey, const ProbeRecord*> parts;
  for (const ProbeRecord& r : probes) {
    if (!is_whole(r)) parts.emplace(part_key(r, r.head, r.expert), &r);
  }
  std::vector<ProbeRecord> rows;
  for (const ProbeRecord& r : probes) {
    if (!is_whole(r) || !passes_filters(r, query)) continue;
    const bool by_head = r.first_head >= 0;
    const bool by_expert = !by_head && r.first_expert >= 0;
    const auto part = by_head || by_expert ? parts.find(part_key(r, by_head ? r.first_head : -1,
                                                                 by_expert ? r.first_expert : -1))
                                           : parts.end();
    rows.push_back(part != parts.end() ? *part->second : r);
  }
  return rows;
}

}  // namespace

std::vector<int64_t> steps_in(const std::vector<ProbeRecord>& probes) {
  std::set<int64_t> steps;
  for (const ProbeRecord& r : probes) steps.insert(r.step);
  return {steps.begin(), steps.end()};
}

std::string describe_steps(const std::vector<int64_t>& ascending_steps) {
  std::string out;
  for (size_t i = 0; i < ascending_steps.size();) {
    size_t j = i;
    while (j + 1 < ascending_steps.size() && ascending_steps[j + 1] == ascending_steps[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ascending_steps[i]) +
           (j > i ? "-" + std::to_string(ascending_steps[j]) : "");
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

TraceSelection select_probes(const std::vector<ProbeRecord>& probes, const TraceQuery& query) {
  std::vector<ProbeRecord> rows;
  if (query.only_nonfinite && query.origin_rows) {
    rows = origin_rows(probes, query);
  } else {
    for (const ProbeRecord& r : probes) {
      if (passes_filters(r, query)) rows.push_back(r);
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const ProbeRecord& a, const ProbeRecord& b) {
    return std::make_pair(a.step, execution_key(a)) < std::make_pair(b.step, execution_key(b));
  });
  if (query.sort_by_max_abs) {
    std::stable_sort(rows.begin(), rows.end(),
                     [](const ProbeRecord& a, const ProbeRecord& b) { return a.stats.max_abs > b.stats.max_abs; });
  }
  TraceSelection selection;
  selection.matched = rows.size();
  if (rows.size() > query.limit) rows.resize(query.limit);
  selection.rows = std::move(rows);
  selection.trace_steps = steps_in(probes);
  return selection;
}

std::string render_trace_table(const TraceSelection& selection) {
  std::ostringstream out;
  char line[512];
  long long nan_values = 0, inf_values = 0;
  std::snprintf(line, sizeof(line), "%-6s %-3s %-4s %-8s %-36s %-4s %-6s %-7s %-5s %-12s %-12s %-8s %-8s %s\n", "step",
                "mb", "rank", "phase", "site", "head", "expert", "sample", "pos", "max|x|", "rms", "nan", "inf", "headroom");
  out << line;
  for (const ProbeRecord& r : selection.rows) {
    std::snprintf(line, sizeof(line), "%-6lld %-3d %-4d %-8s %-36s %-4d %-6d %-7lld %-5lld %-12s %-12s %-8lld %-8lld %s\n",
                  static_cast<long long>(r.step), r.micro_batch, r.rank, phase_name(r.phase), printable(probe_name(r)).c_str(),
                  r.head, r.expert, static_cast<long long>(r.sample), static_cast<long long>(r.position), format_number(r.stats.max_abs).c_str(), format_number(r.stats.rms()).c_str(),
                  static_cast<long long>(r.stats.nan_count), static_cast<long long>(r.stats.inf_count),
                  format_number(r.headroom_bits).c_str());
    out << line;
    nan_values += r.stats.nan_count;
    inf_values += r.stats.inf_count;
  }
  if (selection.matched == 0) {
    out << "(no row matches; the trace holds steps " << describe_steps(selection.trace_steps) << ")\n";
    return out.str();
  }
  out << "(" << selection.rows.size() << " of " << selection.matched << " matching rows; the rows shown hold " << nan_values
      << " nan and " << inf_values << " inf values)\n";
  return out.str();
}

nlohmann::json trace_selection_json(const TraceSelection& selection) {
  nlohmann::json rows = nlohmann::json::array();
  for (const ProbeRecord& r : selection.rows) {
    rows.push_back({{"step", r.step}, {"micro_batch", r.micro_batch}, {"rank", r.rank},
                    {"phase", phase_name(r.phase)}, {"site", printable(probe_name(r))}, {"layer", r.layer},
                    {"head", r.head}, {"expert", r.expert}, {"routed_tokens", r.routed_tokens}, {"max_abs", json_number(r.stats.max_abs)}, {"rms", json_number(r.stats.rms())},
                    {"nan_count", r.stats.nan_count}, {"inf_count", r.stats.inf_count},
                    {"headroom_bits", json_number(r.headroom_bits)}, {"sample", r.sample},
                    {"position", r.position}});
  }
  return {{"matched", selection.matched}, {"rows", rows}, {"trace_steps", selection.trace_steps}};
}

}  // namespace nanreplay
