// The update statistics of a step whose parameters come from a checkpoint
// (update_stats.h): what NUMERIC_UPDATE_SPIKE reads in a per-step bundle,
// where rolling forward measures its own updates instead. The update of step
// s is model(s+1) - model(s) as the two checkpoints hold them; g^2 / v_hat
// reads s's gradients and the optimizer state of s's checkpoint. Both files
// are read a slice of rows at a time (whole for a rule that reads the whole
// tensor), one tensor at a time, as the update check reads them.
#pragma once

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/step.h"
#include "reports/results/update_stats.h"

namespace nanreplay {

struct CheckpointUpdateInput {
  const StepFiles* current = nullptr;  // step s, with a checkpoint (`checkpoint`)
  // Step s + 1 with a checkpoint; null when s is the bundle's last step: then
  // the update is the optimizer's own on s's checkpoint and state (as rolling
  // forward measures its last step), or none without that state.
  const StepFiles* next = nullptr;
  const ModelCheckpoint* checkpoint = nullptr;
  const StepResult* grads = nullptr;  // averaged, unscaled, before clipping
  const StepState* state = nullptr;   // s's state.json (each group's lr)
  bool skipped_by_scaler = false;     // no update: no gradient ratio either
};

// Per tensor in the checkpoint's order; `tensors` empty when nothing could be measured.
StepUpdateStats checkpoint_update_stats(const Bundle& bundle, const CheckpointUpdateInput& input);

}  // namespace nanreplay
