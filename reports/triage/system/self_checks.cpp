// See self_checks.h.
#include "reports/triage/system/self_checks.h"

#include <optional>

#include <torch/torch.h>

#include "reports/triage/system/probe_comparison.h"
#include "replay/step/step.h"
#include "replay/step/step_scan.h"

namespace nanreplay {

namespace {

// The statistics of the first probe that differed, in each replay.
struct DifferingStats {
  std::optional<TensorStats> first, again;
};

// `files.step` replayed again with every probe on `placement`, compared with
// the first run's probes; `into` takes the comparison.
DifferingStats replay_and_compare(const Bundle& bundle, const RecheckInput& step,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement,
                                   const std::optional<PassRef>& only, ReplayComparison& into) {
  const StepFiles& files = step.files;
  const StepBatch batch = batch_of_step(bundle, files.step);
  ModelCheckpoint checkpoint =
      step.params != nullptr ? step.params->share() : ModelCheckpoint(files, bundle.manifest().model);
  StepRequest request;
  request.only_pass = only;
  const StepResult again =
      replay_step({bundle.manifest(), bundle.tokens(), files.step, step.state, batch}, checkpoint, placement, request);
  const auto in_pass = [&](const ProbeRecord& r) {
    return !only || (r.phase != Phase::kGrad && r.rank == only->rank && r.micro_batch == only->micro_batch);
  };
  std::vector<const ProbeRecord*> before;
  for (const ProbeRecord& r : first_run) {
    if (r.step == files.step && in_pass(r)) before.push_back(&r);
  }
  const ProbeComparison cmp = compare_probes(before, again.probes);
  into.step = files.step;
  into.probes_compared = cmp.compared;
  into.identical = cmp.difference.empty();
  into.first_difference = cmp.difference;
  into.where = cmp.where();
  DifferingStats stats;  // copied: cmp points into `again`, which ends here
  if (cmp.a != nullptr) stats = {cmp.a->stats, cmp.b->stats};
  return stats;
}

}  // namespace

DeterminismCheck check_determinism(const Bundle& bundle, const RecheckInput& step,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement,
                                   const std::optional<PassRef>& only) {
  DeterminismCheck check;
  check.checked = true;
  check.whole_step = !only;
  if (only) {
    check.rank = only->rank;
    check.micro_batch = only->micro_batch;
  }
  replay_and_compare(bundle, step, first_run, placement, only, check);
  return check;
}

CrossDeviceCheck check_across_devices(const Bundle& bundle, const RecheckInput& step,
                                      const std::vector<ProbeRecord>& first_run, const ComputePlacement& second,
                                      const std::string& name_a, const std::string& name_b) {
  CrossDeviceCheck check;
  check.device_a = name_a;
  check.device_b = name_b;
  const DifferingStats differing = replay_and_compare(bundle, step, first_run, second, std::nullopt, check);
  if (differing.first) {
    check.max_abs_a = differing.first->max_abs;
    check.max_abs_b = differing.again->max_abs;
    check.sum_a = differing.first->sum;
    check.sum_b = differing.again->sum;
  }
  return check;
}

}  // namespace nanreplay
