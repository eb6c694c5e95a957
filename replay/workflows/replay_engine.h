// Replays every step of a bundle, forward and backward, on this machine:
// each rank's micro-batches in turn, with probes on every site, and names the
// first non-finite tensor in execution order (step, micro-batch, phase, site,
// rank). Holds at most one step's checkpoint at a time. No LibTorch types here.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include "loaders/bundle/bundle.h"
#include "reports/results/report.h"
#include "replay/step/runtime.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

struct ReplayProgress {
  size_t step_index = 0;  // 0-based among the steps being replayed
  size_t step_count = 0;
  int64_t step = 0;
  int rank = 0;
  int micro_batch = 0;
  std::string phase;  // "forward", "backward", "grad"
  int layer = -1;     // a layer-streamed replay: the block being computed
  int num_layers = 0;
};

struct ReplayOptions {
  bool probes = true;
  std::optional<std::set<int64_t>> only_steps;  // default: every step
  std::function<void(const ReplayProgress&)> on_progress;
  std::function<bool()> should_stop;  // polled between micro-batches; true: throws Interrupted
  std::string tool_version;
  std::optional<TriageThresholds> thresholds;  // default: for the bundle's precision
  SpikeOverrides spike;  // run's --spike-* flags and --incident-kind (docs/spikes.md)
  bool check_updates = true;      // model(s+1) against AdamW(model(s)): flipped bits
  bool check_determinism = true;  // one step replayed twice, compared bitwise
  // "cpu", "cuda:N", or two devices: the layers split across them, or with
  // cross_check the same step replayed on each and compared bit for bit.
  std::vector<std::string> devices{"cpu"};
  bool cross_check = false;
  // bf16/fp16 in the low type on a GPU ("native"); emulated by rounding fp32
  // elsewhere and when false.
  bool native_low_precision = true;
  // When set, each step's probe records go here as the step ends (to the
  // trace), and report.probes keeps only the steps that matter
  // (replay/probing/probe_retention.h): memory stays flat however long the window.
  std::function<void(const std::vector<ProbeRecord>&)> on_step_probes;
  // Set: replay layer by layer (replay/step/layer_stream.h), the scratch files in
  // a directory made inside this one and removed at the end.
  std::optional<std::filesystem::path> stream_scratch;
  // Prepare each next step's logged state, batch and data findings on a
  // worker thread while this one computes. Default: on a GPU only (on a CPU
  // the worker would take cores from the step).
  std::optional<bool> prepare_ahead;
};

// What the Interrupted (loaders/base/error.h) thrown when should_stop() returned
// true says: "interrupted after 2 of 4 steps; nothing was written".
std::string interrupted_after_steps(size_t steps_done, size_t step_count);

ReplayReport replay_bundle(const Bundle& bundle, const ReplayOptions& options);

}  // namespace nanreplay


