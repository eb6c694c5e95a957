// See self_checks.h.
#include "replay/self_checks.h"

#include <torch/torch.h>

#include "replay/probe_comparison.h"
#include "replay/step.h"
#include "replay/step_scan.h"

namespace nanreplay {

namespace {

// `files.step` replayed again with every probe on `placement`, compared with the first run's probes.
ProbeComparison replay_and_compare(const Bundle& bundle, const StepFiles& files,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement) {
  const StepState state = bundle.load_state(files);
  const StepBatch batch = batch_of_step(bundle, files.step);
  ModelCheckpoint checkpoint(files, bundle.manifest().model);
  const StepResult again =
      replay_step({bundle.manifest(), bundle.tokens(), files.step, state, batch}, checkpoint, placement, {});
  std::vector<const ProbeRecord*> before;
  for (const ProbeRecord& r : first_run) {
    if (r.step == files.step) before.push_back(&r);
  }
  return compare_probes(before, again.probes);
}

}  // namespace

DeterminismCheck check_determinism(const Bundle& bundle, const StepFiles& files,
                                   const std::vector<ProbeRecord>& first_run, const ComputePlacement& placement) {
  const ProbeComparison cmp = replay_and_compare(bundle, files, first_run, placement);
  DeterminismCheck check;
  check.checked = true;
  check.step = files.step;
  check.probes_compared = cmp.compared;
  check.identical = cmp.difference.empty();
  check.first_difference = cmp.difference;
  check.where = cmp.where();
  return check;
}

CrossDeviceCheck check_across_devices(const Bundle& bundle, const StepFiles& files,
                                      const std::vector<ProbeRecord>& first_run, const ComputePlacement& second,
                                      const std::string& name_a, const std::string& name_b) {
  const ProbeComparison cmp = replay_and_compare(bundle, files, first_run, second);
  CrossDeviceCheck check;
  check.device_a = name_a;
  check.device_b = name_b;
  check.step = files.step;
  check.probes_compared = cmp.compared;
  check.identical = cmp.difference.empty();
  check.first_difference = cmp.difference;
  check.where = cmp.where();
  if (cmp.a != nullptr) {
    check.max_abs_a = cmp.a->stats.max_abs;
    check.max_abs_b = cmp.b->stats.max_abs;
    check.sum_a = cmp.a->stats.sum;
    check.sum_b = cmp.b->stats.sum;
  }
  return check;
}

}  // namespace nanreplay
