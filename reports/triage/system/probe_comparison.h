// Two replays of one step compared probe by probe, bit for bit: the
// determinism self-check (same device twice) and --cross-check (two
// devices). Torch-free: it compares ProbeRecords, not tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "probes/probe_record.h"
#include "reports/results/report.h"

namespace nanreplay {

// Whether two statistics are the same bits (NaN sums included).
bool same_stats(const TensorStats& a, const TensorStats& b);

// Where two replays of one step first differ.
struct ProbeComparison {
  int64_t compared = 0;
  const ProbeRecord* a = nullptr;  // the first pair that differs, if any
  const ProbeRecord* b = nullptr;
  std::string difference;          // "" when identical, else "<phase> <site>" or the probe counts

  ProbeDifference where() const;
};

ProbeComparison compare_probes(const std::vector<const ProbeRecord*>& before, const std::vector<ProbeRecord>& again);

// Evidence of a finding about two replays that disagree: `step`, then the
// site under its own name (as in every other finding), its `phase`, `rank`,
// `micro_batch`, `head` and `expert` (null where they do not apply).
Evidence difference_evidence(int64_t step, const ProbeDifference& where);

}  // namespace nanreplay
