// The outcome of `nanreplay bisect` as plain data (its renderings are in
// reports/outputs/bisect_output.h). Every replay count is
// in passes: one forward and backward of one batch (a rank's micro-batch, or a
// subset of a step's samples).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/report.h"
#include "reports/results/spike.h"

namespace nanreplay {

constexpr int kBisectVersion = 1;

// One step the binary search replayed with the cheap any-non-finite pass.
struct BisectStepTest {
  int64_t step = 0;
  bool replayed = true;
  std::string not_replayed_reason;  // a token id out of range: the step cannot run
  bool bad = false;
  bool handled_overflow = false;    // fp16 backward overflow the loss scaler skips: not bad
  int64_t replays = 0;
};

struct BisectSampleStage {
  bool ran = false;
  std::vector<int64_t> candidates;  // the samples of the pass holding the origin, in batch order
  std::vector<int64_t> minimal;     // 1-minimal subset that still fails (ddmin); empty when not data-dependent
  // `minimal` in the run's numbering, where the bundle records it for every one of them
  // (original_samples / original_offsets); empty otherwise.
  std::vector<OriginalSample> minimal_in_run;
  // Whether the failure depends on which samples the pass holds: false when
  // single samples fail broadly (a weight that makes every sample fail), so
  // no sample is named. None when the stage did not run.
  std::optional<bool> data_dependent;
  int64_t replays = 0;
  std::string note;                 // why the stage did not run or found nothing
};

struct BisectReport {
  std::string bundle;
  std::string tool_version;
  Arch arch = Arch::kLlama;
  Compute precision = Compute::kFp32;
  int64_t steps_in_bundle = 0;
  int64_t passes_per_step = 0;          // world_size x grad_accum_steps
  int64_t full_probe_pass_replays = 0;  // what `run` replays: every pass of every replayable step

  std::optional<FirstNonfinite> origin;  // equals `run`'s first_nonfinite
  std::vector<OriginToken> origin_tokens;  // as `run` reports them
  // Stage 1, step: binary search with the any-non-finite pass, in test order;
  // `in_order` when the bundle rolls forward (derivation cannot skip a step).
  std::vector<BisectStepTest> step_tests;
  bool in_order = false;
  std::optional<int64_t> clean_predecessor;  // the step before the first bad one, tested clean
  // Stage 2, layer: read off the flags of the bad step's pass (no replay of its own).
  // Stage 3, site/head/element: full probes on that block of that one pass.
  int64_t site_replays = 0;
  // Stage 4, samples: delta debugging over the samples of the origin's pass.
  BisectSampleStage samples;

  std::optional<std::vector<WhatIfOutcome>> what_if;
  // Steps whose logged loss (state.json) is non-finite: with no origin, the
  // job saw something this replay does not reproduce (`run` says why).
  std::vector<int64_t> logged_nonfinite_steps;
  // What triage found in the evidence bisect has or cheaply gets (the same
  // rules as `run`): shard checksums, recorded samples, token ids, and with
  // no origin the last step's per-rank losses and the update into the last
  // checkpoint (rolling forward: every step walked).
  std::vector<Finding> findings;
  int64_t check_replays = 0;  // passes replayed for those checks alone (the step before the last)
  // A spike incident or logged per-site statistics: run's full probe pass,
  // whose spike report, findings and root cause bisect then gives (bisect_verdict.h).
  int64_t full_pass_replays = 0;
  std::optional<SpikeReport> spike;
  // run's rules over what bisect found (reports/triage/triage_rules.h).
  std::optional<RootCause> root_cause;
  double elapsed_seconds = 0.0;

  int64_t step_replays() const;
  int64_t origin_replays() const;   // stages step + layer + site
  int64_t what_if_replays() const;
  int64_t total_replays() const;
  bool any_not_replayed() const;
};

// As `run` on the same bundle: 1 when an origin or a spike origin was named, a tested step
// could not be replayed, the job logged a non-finite loss no tested step
// reproduces (run's SYSTEM_NOT_REPRODUCIBLE), or triage found an error; else 0.
int bisect_exit_status(const BisectReport& report);

}  // namespace nanreplay
