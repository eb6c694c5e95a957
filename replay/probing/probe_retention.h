// Which probe records a replay keeps in its report once each step's records
// have gone to the trace. Long windows must not grow memory with every step,
// yet the report's heatmaps and the self-checks need the steps that matter:
// the first bad step and its neighbours, and the last steps (the ones the
// self-checks replay again when nothing went non-finite). Everything else is
// in trace.h5 only.
#pragma once

#include <cstdint>
#include <deque>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "probes/probe_record.h"

namespace nanreplay {

class ProbeRetention {
 public:
  // `kept` receives the records kept, steps in increasing order.
  explicit ProbeRetention(std::vector<ProbeRecord>& kept) : kept_(kept) {}

  // One step's records, after they went to the trace. `origin_step`: the
  // first bad step once it is known.
  void step_done(int64_t step, std::vector<ProbeRecord> records, std::optional<int64_t> origin_step) {
    const bool origin_here = origin_step && *origin_step == step;
    const bool after_origin = origin_step && *origin_step + 1 == step;
    if (origin_here && !recent_.empty() && recent_.back().first + 1 == step) {
      keep(std::move(recent_.back().second));  // the step before the origin
    }
    if (origin_here || after_origin) {
      recent_.clear();
      keep(std::move(records));
      return;
    }
    recent_.emplace_back(step, std::move(records));
    if (recent_.size() > kLastSteps) recent_.pop_front();
  }

  // After the last step: the last steps not kept yet.
  void finish() {
    for (auto& [step, records] : recent_) keep(std::move(records));
    recent_.clear();
  }

  static constexpr size_t kLastSteps = 2;
  // Kept and recent steps at most (the origin and its two neighbours, the
  // last steps), plus the step in flight and the trace's copy of it.
  static constexpr size_t kMostStepsHeld = 3 + kLastSteps + 2;

 private:
  void keep(std::vector<ProbeRecord> records) {
    kept_.insert(kept_.end(), std::make_move_iterator(records.begin()), std::make_move_iterator(records.end()));
  }

  std::vector<ProbeRecord>& kept_;
  std::deque<std::pair<int64_t, std::vector<ProbeRecord>>> recent_;
};

}  // namespace nanreplay
