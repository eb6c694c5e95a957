// The system layer of triage over plain data: what the job logged per rank
// against the replay, the fp16 scaler's logged skip against the replay's,
// the shards against their checksums, and the replay against itself (twice
// on one device, or on two). Thresholds: reports/results/triage_thresholds.h.
#pragma once

#include <cstdint>
#include <vector>

#include "loaders/bundle/step_state.h"
#include "loaders/bundle/token_shards.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

// Whether every rank's logged gradient norm is the step's replayed global
// norm, where the ranks' own norms differ from it: the common convention of
// logging clip_grad_norm_'s result on each rank.
bool rank_norms_logged_global(const StepOutcome& step, const StepState& state, const TriageThresholds& thresholds);
// SYSTEM_RANK_MISMATCH per rank whose logged loss (or grad norm, unless
// `norms_logged_global`; default: the step's own flag) misses its replayed share.
std::vector<Finding> rank_mismatch_findings(const StepOutcome& step, const StepState& state,
                                            const TriageThresholds& t);
std::vector<Finding> rank_mismatch_findings(const StepOutcome& step, const StepState& state,
                                            const TriageThresholds& t, bool norms_logged_global);
// SYSTEM_NOT_REPRODUCIBLE where an fp16 step's logged `skipped` disagrees
// with whether the replay's gradients make the scaler skip it.
std::vector<Finding> scaler_skip_findings(const StepOutcome& step, const StepState& state, Compute compute);
// BUNDLE_CHECKSUM_MISMATCH per shard whose sha256 is not the manifest's.
std::vector<Finding> checksum_findings(const std::vector<ChecksumMismatch>& mismatches);
// SYSTEM_NONDETERMINISTIC when replaying `step` twice gave different values.
std::vector<Finding> determinism_findings(int64_t step, const DeterminismCheck& check);
// SYSTEM_DEVICE_MISMATCH when `step` replayed on two devices differs.
std::vector<Finding> device_mismatch_findings(int64_t step, const CrossDeviceCheck& check);

}  // namespace nanreplay
