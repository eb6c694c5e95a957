// Bisection: names the same origin as `nanreplay run`'s full probe pass with
// fewer replays, coarse to fine. (1) step: the last step with the cheap
// any-non-finite pass, or when it is clean the steps the log marks (a
// non-finite loss, or skipped by the fp16 scaler: a transient failure), then
// a binary search below the first bad one, assuming a step after the first
// bad one stays bad until there; (2) layer: read off that pass's per-site flags; (3) site, head and
// element: full probes on that block of the one pass holding it; (4) samples:
// delta debugging over that pass's samples, down to a 1-minimal set whose
// presence still makes a non-finite value, or "not data-dependent" when
// single samples fail broadly. Besides, the checks `run` makes that need no
// more than bisect has, through the same triage entry points (checksums,
// samplers; with no origin the last two steps against the log and the update
// into the last checkpoint), so both exit alike. Algorithm and replay unit:
// docs/bisect-and-what-if.md. No LibTorch types here.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/workflows/what_if.h"
#include "reports/results/bisect_report.h"

namespace nanreplay {

struct BisectProgress {
  std::string stage;  // "step", "site", "samples", "what-if"
  int64_t step = 0;
  int64_t replays = 0;  // passes so far, all stages
};

struct BisectOptions {
  bool minimize_samples = true;  // stage 4
  std::vector<WhatIf> what_ifs;  // replayed at the first bad step, after the stages
  std::function<void(const BisectProgress&)> on_progress;
  std::function<bool()> should_stop;  // polled before every pass; true: throws Interrupted
  std::string tool_version;
  // --device: where every pass computes (one device, or two with the layers split).
  std::vector<std::string> devices{"cpu"};
  bool native_low_precision = true;  // bf16/fp16 natively on a GPU
  // Set: every pass layer by layer, scratch files in a directory made inside this one.
  std::optional<std::filesystem::path> stream_scratch;
};

BisectReport bisect_bundle(const Bundle& bundle, const BisectOptions& options);

}  // namespace nanreplay
