// The one way into triage: a workflow hands each stage's evidence to triage
// once, as a plain struct, and gets the findings back. Only reports/triage/
// makes findings; each rule sits in the folder of its layer (data/,
// numeric/, system/). The stages, in the order a replay meets them:
//   triage_bundle     before any step: shards against checksums, checkpoints
//   triage_host_step  a step's host share: sampler, token ids, sample profiles
//                     (apart, so a worker thread can prepare it ahead)
//   triage_step       after a step's replay: its numeric and system findings
//   triage_update     the update from one checkpoint to the next (timed apart)
//   triage_window     after the steps: what they found together
//   triage_recheck    the replay against itself (twice, or on two devices)
//   triage_verdict    everything together: the verdict and the root cause
//   triage_reproduction  for a workflow that replays only some steps (bisect):
//                     those steps against what the job logged
// Adding a finding: a row in finding_code_table (reports/results/finding.cpp),
// its rule in its layer's folder, called from the stage whose evidence it
// reads (a field added to that stage's struct if it needs more).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "probes/data_checks.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"
#include "reports/results/update_stats.h"
#include "reports/triage/system/system_checks.h"

namespace nanreplay {

struct BundleEvidence {
  std::vector<ChecksumMismatch> checksum_mismatches;  // the shards against the manifest's sha256
  const Bundle* checkpoints = nullptr;  // set: every checkpoint read for non-finite values
};
// BUNDLE_CHECKSUM_MISMATCH, then CHECKPOINT_NONFINITE.
std::vector<Finding> triage_bundle(const BundleEvidence& evidence);

struct HostStepEvidence {
  const Bundle& bundle;
  const StepEntry& entry;  // the step's manifest entry (recorded samples)
  const StepBatch& batch;  // the samples the step reads, per rank
  const DataBaseline* baseline = nullptr;  // the stream's own samples; null: no profile checks
  DataCheckOptions data;
};
struct HostStepFindings {
  std::vector<Finding> sampler;     // DATA_SAMPLER_MISMATCH
  std::vector<Finding> bad_tokens;  // DATA_TOKEN_OUT_OF_RANGE: the step cannot be replayed
  std::vector<Finding> profile;     // DATA_REPEAT_RUN / DATA_LOW_ENTROPY, when every id is in range
};
HostStepFindings triage_host_step(const HostStepEvidence& evidence);

struct StepEvidence {
  const StepOutcome& outcome;  // the replayed values, the scaler's skip judged
  const StepState& state;      // what the job logged (loss scale as replayed)
  const std::vector<ProbeRecord>& probes;
  const std::vector<NormCheck>& norm_checks;
  const std::vector<SampleLoss>& sample_losses;
  const ProbeRecord* handled_overflow_at = nullptr;  // the first value the fp16 scaler absorbs
  const ModelConfig& model;
  Compute compute = Compute::kFp32;
  // The input token id at (sample, position), -1 where unknown: what
  // NUMERIC_EXPERT_OUTLIER_ACTIVATION names. Empty: none named.
  std::function<int64_t(int64_t sample, int64_t position)> token_at;
  // The window's steps replayed before this one (their expert maxima: what an
  // expert is compared with over time); none: nothing earlier.
  const std::vector<StepOutcome>* earlier_steps = nullptr;
};
struct StepTriage {
  std::vector<Finding> findings;
  std::vector<std::vector<int64_t>> expert_tokens;  // [layer][expert]; empty for a dense model
  bool rank_norms_logged_global = false;            // system_rules.h
};
StepTriage triage_step(const StepEvidence& evidence, const TriageThresholds& thresholds);

struct UpdateEvidence {
  const Bundle& bundle;
  const StepFiles& current;  // step s
  const StepFiles& next;     // step s + 1, whose checkpoint is what the run held
  // s's checkpoint with `grads`; rolling forward (no grads), the tool's own update of s.
  const ModelCheckpoint& params;
  const StepResult* grads = nullptr;
  double lr = 0.0;
  bool skipped_by_scaler = false;
};
// SYSTEM_BIT_FLIP / SYSTEM_UPDATE_MISMATCH.
std::vector<Finding> triage_update(const UpdateEvidence& evidence);

// The root cause run's rules pick from an origin and findings alone (bisect's verdict).
RootCause root_cause_of(const std::optional<FirstNonfinite>& origin, std::vector<Finding> findings);

struct WindowEvidence {
  const Bundle& bundle;
  const std::set<int64_t>& batch_samples;  // every sample a replayed step's batch holds
  const std::vector<StepState>& states;    // the replayed steps' states, in order
  // Each update's statistics (derived, or between checkpoints), in step order,
  // and the incident's step (the first non-finite value's, or the spike's).
  const std::vector<StepUpdateStats>* updates = nullptr;
  std::optional<int64_t> incident_step;
};
// DATA_TOKEN_OUT_OF_RANGE no batch reads, NUMERIC_FP8_SCALE_JUMP, NUMERIC_UPDATE_SPIKE.
std::vector<Finding> triage_window(const WindowEvidence& evidence, const TriageThresholds& thresholds);

struct RecheckEvidence {
  int64_t step = 0;
  const DeterminismCheck* determinism = nullptr;  // null: not checked
  const CrossDeviceCheck* cross_check = nullptr;  // null: not checked
};
// SYSTEM_NONDETERMINISTIC, SYSTEM_DEVICE_MISMATCH.
std::vector<Finding> triage_recheck(const RecheckEvidence& evidence);

// Settles the verdict (verdict.h), notes defaulted values beside it, and names
// every sample in the run's own numbering too.
void triage_verdict(ReplayReport& report, const TriageThresholds& thresholds, const Manifest& manifest);

// The replayed `steps` against their logged loss and norm, as triage_verdict
// judges a whole window (verdict.h's judge_reproduction): a logged non-finite
// loss the replay does not reproduce, one odd step (SYSTEM_NOT_REPRODUCIBLE),
// most or all of them off (BUNDLE_DOES_NOT_REPRODUCE), the log's conventions.
std::vector<Finding> triage_reproduction(const std::vector<StepOutcome>& steps, Compute precision,
                                         const TriageThresholds& thresholds);

}  // namespace nanreplay
