// Minimization: the smallest bundle that still fails the same way
// (docs/minimize.md). Bisection names the origin and, by delta debugging, the
// samples that trigger it; this turns that into candidate bundles, smallest
// first (one step, the minimal samples as one micro-batch of one rank, the
// model cut after the origin's layer), writes each one, replays it with
// bisect and keeps the first whose origin is the original's (step, phase,
// site, layer, head, expert, kind, position, and the sample mapped back to its
// original index). A candidate that changes the origin is recorded and a
// larger one tried; when none reproduces, nothing is kept. No LibTorch types here.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "loaders/bundle.h"
#include "reports/bisect_report.h"
#include "reports/minimize_report.h"

namespace nanreplay {

struct MinimizeOptions {
  // An empty directory the candidates are written into (one subdirectory
  // each); the caller renames the accepted one into place.
  std::filesystem::path workspace;
  std::string tool_version;
  std::vector<std::string> devices{"cpu"};
  bool native_low_precision = true;
  std::function<bool()> should_stop;  // polled before every pass: true throws Interrupted
  std::function<void(const std::string& stage)> on_progress;
};

struct MinimizeOutcome {
  MinimizeReport report;
  // The candidate that reproduces (under workspace); empty when nothing is to be written.
  std::filesystem::path accepted;
};

// `bisected`: bisect_bundle's report on `bundle` with the samples stage run.
// Throws std::runtime_error (exit 3) when no candidate reproduces the origin,
// the whole failing step included: the tool could not write a faithful bundle.
MinimizeOutcome minimize_bundle(const Bundle& bundle, const BisectReport& bisected, const MinimizeOptions& options);

// Bytes of every regular file under `dir`, recursively.
uint64_t directory_bytes(const std::filesystem::path& dir);

}  // namespace nanreplay
