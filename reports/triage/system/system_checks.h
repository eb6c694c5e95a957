// The system layer of triage that needs the checkpoints themselves:
// parameters or moments already non-finite in a checkpoint (found before any
// replay), and the update check: model(s+1) against PyTorch's AdamW applied
// to model(s), naming every element whose deviation is one flipped bit of
// its stored encoding. Checkpoints are read through their mappings, one
// tensor at a time.
#pragma once

#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/step.h"
#include "reports/results/report.h"

namespace nanreplay {

// CHECKPOINT_NONFINITE findings: which tensors, how many elements, from which step on.
std::vector<Finding> checkpoint_nonfinite_findings(const Bundle& bundle);

struct UpdateCheckInput {
  const StepFiles* current = nullptr;  // step s (its checkpoint is `checkpoint`)
  const StepFiles* next = nullptr;     // step s + 1
  const ModelCheckpoint* checkpoint = nullptr;
  const StepResult* grads = nullptr;  // averaged, unscaled, before clipping
  double lr = 0.0;
  bool skipped_by_scaler = false;        // then model(s+1) must equal model(s)
};

// SYSTEM_BIT_FLIP (error) per flipped element, SYSTEM_UPDATE_MISMATCH
// (warning) per parameter whose deviations no single bit explains.
std::vector<Finding> update_findings(const Bundle& bundle, const UpdateCheckInput& input);

// Parameters whose L2 norm differs between the checkpoints of `before` and
// `after` by `factor` times or more, both finite: farther than an optimizer
// step moves a tensor, so the update check between them is worth a replay
// (bisect's screen). Reads the two model files one tensor at a time.
std::vector<std::string> jumped_params(const StepFiles& before, const StepFiles& after, double factor);

// The same, rolling forward: the tool's own update of derived step `current`
// (`predicted`, read one parameter at a time) against the checkpoint of
// `next`, what the run really held there.
std::vector<Finding> derived_update_findings(const Bundle& bundle, const StepFiles& current, const StepFiles& next,
                                             const ModelCheckpoint& predicted, double lr);

}  // namespace nanreplay
