// The outcome of `nanreplay minimize` as plain data; its renderings are in
// reports/outputs/minimize_output.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/report.h"

namespace nanreplay {

constexpr int kMinimizeVersion = 1;

// What a bundle holds, counted the same way before and after.
struct BundleSize {
  uint64_t bytes = 0;        // every regular file under the bundle directory
  int64_t steps = 0;
  int64_t checkpoints = 0;   // steps with model.safetensors
  int64_t samples = 0;       // distinct samples the steps read
  int64_t tokens = 0;        // tokens in the shards
  int64_t layers = 0;
  int64_t world_size = 0;
  int64_t grad_accum_steps = 0;
  int64_t micro_batch_size = 0;
};

// A flipped bit the update check names (SYSTEM_BIT_FLIP, docs/triage.md):
// the one tensor that shows it, in the checkpoint of `step`, against AdamW
// applied to the checkpoint of step - 1.
struct FlippedBit {
  int64_t step = 0;
  std::string param;
  std::vector<int64_t> index;
  int64_t bit = 0;
  double before = 0.0;    // the value the flip destroyed
  double after = 0.0;     // what the checkpoint holds
  double expected = 0.0;  // what AdamW predicts
  std::string message;    // the finding's own
};

// One candidate bundle replayed and judged; rejected ones say why.
struct MinimizeAttempt {
  std::string cut;     // what this candidate removes, in words
  bool reproduced = false;
  std::string outcome;  // "same origin", or how it differed
};

struct MinimizeReport {
  std::string bundle;  // as given
  std::string out;     // as given; empty until written
  std::string tool_version;
  // "origin": a non-finite origin; "spike": no non-finite origin, but a
  // reproduced spike origin (docs/spikes.md); "bit_flip": no origin, but the
  // update check names a flipped bit; "none": nothing to minimize (nothing written).
  std::string finding = "none";
  std::string reason;  // "none": why nothing was written
  std::vector<std::string> not_minimized;  // "none": error findings minimize has no cut for (codes)
  std::optional<FirstNonfinite> origin;           // the original bundle's, as bisect names it
  std::optional<FirstNonfinite> origin_after;     // the minimized bundle's, as its replay named it
  std::optional<int64_t> original_sample;         // the origin's sample as an index of the original stream
  std::optional<SpikeReport> spike;               // "spike": the original bundle's, as bisect names it
  std::optional<SpikeReport> spike_after;         // "spike": the minimized bundle's
  std::optional<FlippedBit> flip;                 // "bit_flip": the original bundle's
  std::optional<FlippedBit> flip_after;           // "bit_flip": the minimized bundle's
  BundleSize before;
  BundleSize after;
  std::vector<std::string> kept;     // what MIN holds and why, one line each
  std::vector<std::string> removed;  // what was cut, one line each
  std::vector<MinimizeAttempt> attempts;  // in the order tried; the last reproduced one was written
  // The failing step's samples (for a flip, the update step's), original indices.
  std::vector<int64_t> kept_samples_original;
  std::string reproduce_command;
  double elapsed_seconds = 0.0;

  bool written() const { return !out.empty(); }
};

}  // namespace nanreplay
