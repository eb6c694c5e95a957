// One step of the replay without the triage around it: every rank's
// micro-batches forward and backward from the step's checkpoint, with or
// without probes, then the parameter-gradient probes. The replay loop and the
// determinism check call it, and so does bench/bench_replay.cpp, which times
// it with probes on and off.
#pragma once

#include <functional>

#include "loaders/bundle.h"
#include "replay/checkpoint.h"
#include "replay/gradients.h"

namespace nanreplay {

// The step's batch as the bundle's sampler draws it.
StepBatch step_batch(const Bundle& bundle, int64_t step);

// `before_pass(rank, micro_batch, phase)` runs before each forward and backward.
// The parameters are placed where `placement` says first (default: the host).
StepGradients replay_step(const Bundle& bundle, const StepFiles& files, const StepState& state,
                          const StepBatch& batch, ModelCheckpoint& checkpoint, bool probes,
                          const std::function<void(int, int, const char*)>& before_pass = {},
                          const ComputePlacement& placement = {});

}  // namespace nanreplay
