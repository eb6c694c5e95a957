// Phase names and the two renderings of PhaseTimings; see timings.h.
#include "reports/results/timings.h"

#include <algorithm>
#include <cstdio>

namespace nanreplay {

namespace {

// One row per TimedPhase, in its order.
constexpr const char* kPhaseNames[] = {"load",        "data_checks", "replay",    "update_checks",
                                       "determinism", "cross_check", "what_ifs",  "trace.h5",
                                       "report.md",   "report.html", "report.json"};
static_assert(sizeof(kPhaseNames) / sizeof(kPhaseNames[0]) == static_cast<size_t>(TimedPhase::kCount),
              "one name per timed phase");

}  // namespace

void PhaseTimings::enter(TimedPhase phase) {
  const Clock::time_point now = Clock::now();
  if (!open_.empty()) add(open_.back().first, std::chrono::duration<double>(now - open_.back().second).count());
  open_.emplace_back(phase, now);
}

void PhaseTimings::leave() {
  const Clock::time_point now = Clock::now();
  add(open_.back().first, std::chrono::duration<double>(now - open_.back().second).count());
  open_.pop_back();
  if (!open_.empty()) open_.back().second = now;  // the outer phase resumes
}

double PhaseTimings::total_seconds() const {
  if (started) return std::chrono::duration<double>(Clock::now() - *started).count();
  double sum = 0.0;
  for (double s : seconds) sum += s;
  return sum;
}

nlohmann::json timings_json(const PhaseTimings& timings) {
  nlohmann::json seconds = nlohmann::json::object();
  for (size_t i = 0; i < static_cast<size_t>(TimedPhase::kReportJson); ++i) seconds[kPhaseNames[i]] = timings.seconds[i];
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& [step, s] : timings.step_seconds) steps.push_back({{"step", step}, {"seconds", s}});
  return {{"seconds", seconds}, {"steps", steps}, {"total_seconds", timings.total_seconds()}};
}

std::string render_timings(const PhaseTimings& timings) {
  const double total_seconds = timings.total_seconds();
  std::string out = "where the time went (seconds):\n";
  char line[160];
  double accounted = 0.0;
  for (size_t i = 0; i < static_cast<size_t>(TimedPhase::kCount); ++i) {
    accounted += timings.seconds[i];
    std::snprintf(line, sizeof line, "  %-14s %8.3f\n", kPhaseNames[i], timings.seconds[i]);
    out += line;
    if (static_cast<TimedPhase>(i) == TimedPhase::kReplay && !timings.step_seconds.empty()) {
      std::string steps = "    steps:";
      const size_t shown = std::min<size_t>(timings.step_seconds.size(), 12);
      for (size_t k = 0; k < shown; ++k) {
        std::snprintf(line, sizeof line, " %lld %.3f%s", static_cast<long long>(timings.step_seconds[k].first),
                      timings.step_seconds[k].second, k + 1 < shown ? "," : "");
        steps += line;
      }
      if (shown < timings.step_seconds.size()) steps += " ... (every step in report.json)";
      out += steps + "\n";
    }
  }
  std::snprintf(line, sizeof line, "  %-14s %8.3f\n  %-14s %8.3f\n", "other", std::max(0.0, total_seconds - accounted),
                "total", total_seconds);
  return out + line;
}

}  // namespace nanreplay
