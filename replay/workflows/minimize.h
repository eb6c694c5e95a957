// Minimization: the smallest bundle that still fails the same way
// (docs/minimize.md). Bisection names the origin and, by delta debugging, the
// samples that trigger it; this turns that into candidate bundles, smallest
// first (one step, the minimal samples as one micro-batch of one rank, the
// model cut after the origin's layer), writes each one, replays it with
// bisect and keeps the first whose origin is the original's (step, phase,
// site, layer, head, expert, kind, position, and the sample mapped back to its
// original index). A candidate that changes the origin is recorded and a
// larger one tried; when none reproduces, nothing is kept.
// Without an origin, the finding is a flipped bit the update check names
// (SYSTEM_BIT_FLIP): the candidates are the two steps around it, with fewer
// samples first, each kept only if the same check on it names the same flip
// (step, parameter, element, bit). No LibTorch types here.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "loaders/bundle/bundle.h"
#include "reports/results/bisect_report.h"
#include "reports/results/minimize_report.h"

namespace nanreplay {

struct MinimizeOptions {
  // Makes the empty directory the candidates are written into (one
  // subdirectory each), once, before the first; never called when nothing is
  // to be minimized. The caller renames the accepted one into place.
  std::function<std::filesystem::path()> workspace;
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
// Without an origin, replays `bundle` as `run` does (without probes) for its
// findings. Throws std::runtime_error (exit 3) when no candidate reproduces
// the finding, the whole step(s) included: the tool could not write a
// faithful bundle.
MinimizeOutcome minimize_bundle(const Bundle& bundle, const BisectReport& bisected, const MinimizeOptions& options);

// Bytes of every regular file under `dir`, recursively.
uint64_t directory_bytes(const std::filesystem::path& dir);

}  // namespace nanreplay
