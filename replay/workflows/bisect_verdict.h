// What bisect decides beyond the first non-finite value, so that it names
// what `run` names on the same bundle (docs/bisect-and-what-if.md): a spike
// incident or logged per-site statistics are judged by run's own full probe
// pass (a site's trajectory needs every step before it); an origin whose
// checkpoint jumped from the one before gets run's update check (weights
// rewritten outside the optimizer outrank the overflow they cause); and the
// root cause is decided by run's rules over what bisect found.
#pragma once

#include <functional>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/workflows/bisect.h"
#include "reports/results/bisect_report.h"

namespace nanreplay {

// Whether `run` judges this bundle by what only its full probe pass sees: a
// spike incident (the manifest's kind, or a logged spike with nothing
// non-finite logged) or per-site statistics in the log.
bool needs_full_probe_pass(const Bundle& bundle);

// run's replay of the whole window with probes (no determinism re-check):
// its spike report, findings and root cause replace bisect's.
void judge_as_run(const Bundle& bundle, const BisectOptions& options, BisectReport& report);

// With an origin: when a tensor of the origin step's checkpoint jumped from
// the step before's by more than an optimizer step moves it, the step before
// is replayed (its passes are check_replays) and run's update check names
// what the optimizer did not compute (SYSTEM_UPDATE_MISMATCH, SYSTEM_BIT_FLIP).
void check_update_into_origin(const Bundle& bundle, const ComputePlacement& placement,
                              const std::function<void()>& before_pass, BisectReport& report);

// report.root_cause by run's rules (reports/triage/triage_rules.h), unless judge_as_run set it.
void settle_bisect_root_cause(BisectReport& report);

}  // namespace nanreplay
