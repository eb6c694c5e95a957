// Trace queries for `nanreplay trace`: filter, order, limit, render as a
// fixed-width table or JSON. Rows come from read_trace.
#include "reports/trace_query.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "loaders/error.h"
#include "reports/report.h"
#include "reports/terminal_text.h"

namespace nanreplay {

// The fnmatch-style glob of replay/adamw.h (`*` any run, `?` one character),
// declared here so this file stays free of LibTorch headers.
bool glob_match(const std::string& pattern, const std::string& name);

std::optional<Phase> parse_phase(const std::string& name) {
  for (Phase phase : {Phase::kForward, Phase::kBackward, Phase::kGrad}) {
    if (name == phase_name(phase)) return phase;
  }
  return std::nullopt;
}

TraceSelection select_probes(const std::vector<ProbeRecord>& probes, const TraceQuery& query) {
  std::vector<ProbeRecord> rows;
  for (const ProbeRecord& r : probes) {
    if (query.step && r.step != *query.step) continue;
    if (query.phase && r.phase != *query.phase) continue;
    if (query.head && r.head != *query.head) continue;
    if (query.expert && r.expert != *query.expert) continue;
    if (!query.site_pattern.empty() && !glob_match(query.site_pattern, probe_name(r))) continue;
    if (query.only_nonfinite && r.stats.all_finite()) continue;
    rows.push_back(r);
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
  return selection;
}

std::string render_trace_table(const TraceSelection& selection) {
  std::ostringstream out;
  char line[512];
  std::snprintf(line, sizeof(line), "%-6s %-3s %-4s %-8s %-36s %-4s %-6s %-12s %-12s %-8s %-8s %s\n", "step", "mb", "rank",
                "phase", "site", "head", "expert", "max|x|", "rms", "nan", "inf", "headroom");
  out << line;
  for (const ProbeRecord& r : selection.rows) {
    std::snprintf(line, sizeof(line), "%-6lld %-3d %-4d %-8s %-36s %-4d %-6d %-12s %-12s %-8lld %-8lld %s\n",
                  static_cast<long long>(r.step), r.micro_batch, r.rank, phase_name(r.phase), printable(probe_name(r)).c_str(),
                  r.head, r.expert, format_number(r.stats.max_abs).c_str(), format_number(r.stats.rms()).c_str(),
                  static_cast<long long>(r.stats.nan_count), static_cast<long long>(r.stats.inf_count),
                  format_number(r.headroom_bits).c_str());
    out << line;
  }
  out << "(" << selection.rows.size() << " of " << selection.matched << " matching rows)\n";
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
  return {{"matched", selection.matched}, {"rows", rows}};
}

}  // namespace nanreplay
