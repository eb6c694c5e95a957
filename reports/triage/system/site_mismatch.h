// SYSTEM_SITE_MISMATCH (docs/spikes.md): a run that logged per-site
// statistics (state.json's logged.site_stats) against the replay of the same
// step. The first forward site, in execution order, whose replayed max |x| or
// rms differs from the logged one beyond the precision's rounding is where
// the training machine computed something else.
#pragma once

#include <cstdint>
#include <vector>

#include "loaders/arch/model_config.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/step_state.h"
#include "reports/results/report.h"

namespace nanreplay {

// Relative tolerance on a logged site statistic: fp32 1e-3, bf16 and fp16
// 2e-2, fp8 1e-1.
double site_stat_tolerance(Compute compute);

// At most one finding: the step's first differing site (its head or expert
// where the difference is there), none when nothing was logged or probed.
// A per_head / per_expert list whose length is not the site's throws
// InputError naming the step's state.json and key.
std::vector<Finding> site_mismatch_findings(int64_t step, const StepState& state,
                                            const std::vector<ProbeRecord>& probes, const ModelConfig& model,
                                            Compute compute);

}  // namespace nanreplay
