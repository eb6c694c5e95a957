// The data layer of a replay that reads the bundle rather than tensors:
// out-of-range token ids in a step's batch and anywhere else in the shards,
// recorded samples against the randperm sampler, each batch sample's profile
// against the stream's own, and the run's own sample indices where a compact
// capture recorded them.
#pragma once

#include <set>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "probes/data_checks.h"
#include "replay/step/gradients.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"
#include "reports/triage/data/data_rules.h"

namespace nanreplay {

// DATA_TOKEN_OUT_OF_RANGE for ids a step's batch reads (the step cannot be replayed).
std::vector<Finding> batch_token_findings(const Bundle& bundle, int64_t step, const StepBatch& batch);

// DATA_TOKEN_OUT_OF_RANGE for ids no replayed batch reads: a shard holding
// one is poisoned even where this window does not read it.
std::vector<Finding> stray_token_findings(const Bundle& bundle, const std::set<int64_t>& batch_samples);

// DATA_SAMPLER_MISMATCH where a step's recorded samples disagree with randperm.
std::vector<Finding> sampler_findings(const Bundle& bundle, const StepEntry& entry);

// DATA_REPEAT_RUN / DATA_LOW_ENTROPY for the batch's samples against the stream's.
std::vector<Finding> batch_profile_findings(const Bundle& bundle, int64_t step, const StepBatch& batch,
                                            const DataBaseline& baseline, const DataCheckOptions& options);

// Adds original_sample / original_offset beside every `sample` of the report.
void annotate_original_samples(ReplayReport& report, const Manifest& manifest);

}  // namespace nanreplay
