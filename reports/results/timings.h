// Where a `run` spent its time, phase by phase: what report.json's `timings`
// and `run --timings` show. One table of phase names; each phase is the sum
// of the wall time spent in it (steady clock), so a phase entered several
// times (the data checks of every step, each trace append) adds up.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace nanreplay {

enum class TimedPhase {
  kLoad,          // open the bundle, validate it, estimate memory
  kDataChecks,    // checksums, non-finite checkpoints, every batch's data checks, stray tokens
  kReplay,        // every step's forward and backward with probes, its triage, rolling forward
  kUpdateChecks,  // the AdamW update compared with the next checkpoint
  kDeterminism,   // the deciding micro-batch replayed again
  kCrossCheck,    // --cross-check: the step on the second device
  kWhatIfs,       // --what-if replays
  kTrace,         // trace.h5: appends as the steps end, then its index and step rows
  kReportMd,
  kReportHtml,
  kReportJson,  // not in report.json itself (it cannot time its own writing)
  kCount
};

// Time is exclusive: while a phase runs inside another (the update check
// within a step's replay, a trace append as the step ends), only the inner
// one is charged, so the phases add up to the run.
struct PhaseTimings {
  using Clock = std::chrono::steady_clock;
  std::array<double, static_cast<size_t>(TimedPhase::kCount)> seconds{};
  std::vector<std::pair<int64_t, double>> step_seconds;  // (step, its replay), in replay order
  std::optional<Clock::time_point> started;              // when the command began: the total's start

  void add(TimedPhase phase, double s) { seconds[static_cast<size_t>(phase)] += s; }
  double of(TimedPhase phase) const { return seconds[static_cast<size_t>(phase)]; }
  // From `started` (or the sum of the phases) to now.
  double total_seconds() const;

  // PhaseTimer's bookkeeping: the phases open now, innermost last.
  void enter(TimedPhase phase);
  void leave();

 private:
  std::vector<std::pair<TimedPhase, Clock::time_point>> open_;
};

// report.json's `timings`: {"seconds": {phase: s, every phase but
// report.json}, "steps": [{"step", "seconds"}], "total_seconds"}.
nlohmann::json timings_json(const PhaseTimings& timings);
// `run --timings`: a line per phase, the steps' own times, what no phase
// accounts for (start-up, the verdict), and the total.
std::string render_timings(const PhaseTimings& timings);

// Charges one phase from its construction to its destruction.
class PhaseTimer {
 public:
  PhaseTimer(PhaseTimings& timings, TimedPhase phase) : timings_(timings) { timings_.enter(phase); }
  ~PhaseTimer() { timings_.leave(); }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  PhaseTimings& timings_;
};

}  // namespace nanreplay
