// Bisect's verdict beyond the first non-finite value; see bisect_verdict.h.
#include "replay/workflows/bisect_verdict.h"

#include <cmath>

#include "replay/step/step_scan.h"
#include "replay/workflows/replay_engine.h"
#include "reports/triage/spike_origin.h"
#include "reports/triage/triage.h"

namespace nanreplay {

namespace {

// A checkpoint tensor whose norm moves this many times in one step was not
// moved by the optimizer (AdamW moves an element by about lr a step).
constexpr double kCheckpointJumpFactor = 2.0;

}  // namespace

bool needs_full_probe_pass(const Bundle& bundle) {
  std::vector<StepState> logged;
  for (const StepFiles& files : bundle.steps()) {
    logged.push_back(bundle.load_state(files));
    if (!logged.back().logged.site_stats.empty()) return true;
  }
  return plan_spike(bundle.manifest().incident, logged, {}).active;
}

void judge_as_run(const Bundle& bundle, const BisectOptions& options, BisectReport& report) {
  ReplayOptions replay;
  replay.check_determinism = false;  // run's re-check of the deciding step decides no spike
  replay.devices = options.devices;
  replay.native_low_precision = options.native_low_precision;
  replay.stream_scratch = options.stream_scratch;
  replay.should_stop = options.should_stop;
  replay.tool_version = options.tool_version;
  replay.on_progress = [&](const ReplayProgress& p) {
    if (options.on_progress) options.on_progress({"spike", p.step, report.total_replays()});
  };
  const ReplayReport run = replay_bundle(bundle, replay);
  for (const StepOutcome& s : run.steps) report.full_pass_replays += s.replayed ? report.passes_per_step : 0;
  report.spike = run.spike;
  report.findings = run.findings;
  report.root_cause = run.root_cause;
}

void check_update_into_origin(const Bundle& bundle, const ComputePlacement& placement,
                              const std::function<void()>& before_pass, BisectReport& report) {
  const Manifest& m = bundle.manifest();
  const StepFiles& files = bundle.step_files(report.origin->step);
  const StepFiles* previous = bundle.find_step_files(report.origin->step - 1);
  if (previous == nullptr || !files.has_model || !previous->has_model || !m.optimizer ||
      !bundle.has_optimizer(*previous)) {
    return;
  }
  if (jumped_params(*previous, files, kCheckpointJumpFactor).empty()) return;
  if (unreplayable_reason(bundle, batch_of_step(bundle, previous->step))) return;
  LoadedStep loaded(bundle, previous->step, placement);
  if (!loaded.state().lr) return;
  StepResult result;
  const StepScan scan = scan_step(loaded, {}, /*stop_at_first_bad=*/true, before_pass, &result);
  report.check_replays += scan.passes;
  if (scan.bad || !scan.complete || (!std::isfinite(result.grad_norm) && !scan.scaler_skips)) return;
  const ModelCheckpoint params(*previous, m.model);
  const std::vector<Finding> found =
      triage_update({bundle, *previous, files, params, &result, *loaded.state().lr, scan.scaler_skips});
  report.findings.insert(report.findings.end(), found.begin(), found.end());
}

void settle_bisect_root_cause(BisectReport& report) {
  if (!report.root_cause) report.root_cause = root_cause_of(report.origin, report.findings);
}

}  // namespace nanreplay
