// The replay checking itself: one step replayed a second time with full
// probes, on the same placement (determinism) or on a second device
// (--cross-check), every probe compared bit for bit with the first replay.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/step.h"
#include "reports/results/report.h"

namespace nanreplay {

// The step replayed again as it first was: its files, the state it was
// replayed with (a rolled-forward loss scale included), and for a derived
// step the parameters it started from (null: its checkpoint).
struct RecheckInput {
  const StepFiles& files;
  StepState state;
  const ModelCheckpoint* params = nullptr;
};

// Replays `only` (a rank's micro-batch: its forward and backward records are
// compared) or, without it, the whole step (every record, parameter
// gradients included).
DeterminismCheck check_determinism(const Bundle& bundle, const RecheckInput& step,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement,
                                   const std::optional<PassRef>& only);

CrossDeviceCheck check_across_devices(const Bundle& bundle, const RecheckInput& step,
                                      const std::vector<ProbeRecord>& first_run, const ComputePlacement& second,
                                      const std::string& name_a, const std::string& name_b);

}  // namespace nanreplay
