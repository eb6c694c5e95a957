// report.json's steps[].expert_activation_max (docs/report-format.md): per
// layer and expert, the largest |x| of the rows entering the expert's MLP and
// of its down projection's output (before the routing weight), over every
// pass of a step, its micro-batches and ranks. Recorded only while an
// ExpertActivationRecorder is alive, so a replay that does not ask pays nothing.
#pragma once

#include <mutex>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "reports/results/report.h"

namespace nanreplay {

class ExpertActivationRecorder {
 public:
  // num_layers: every layer with sites (layers_with_sites, probes/sites.h), model.mtp's blocks after
  // the decoder's, each row the layer its sites name.
  ExpertActivationRecorder(int64_t num_layers, int64_t num_experts);  // starts recording
  ~ExpertActivationRecorder();                                        // stops
  ExpertActivationRecorder(const ExpertActivationRecorder&) = delete;
  ExpertActivationRecorder& operator=(const ExpertActivationRecorder&) = delete;

  // [layer]: none where no expert layer was seen (a dense layer, or one another process replayed).
  std::vector<std::optional<std::vector<ExpertActivationMax>>> maxima() const;

  // The experts of `layer` read `input` (routed rows, grouped by expert as
  // `offsets` says: num_experts + 1 row offsets) and computed `output`
  // (the same rows). A no-op when no recorder is alive. A NaN is kept.
  static void record(int layer, const torch::Tensor& input, const torch::Tensor& output,
                     const std::vector<int64_t>& offsets);

 private:
  mutable std::mutex mutex_;
  int64_t num_experts_ = 0;
  std::vector<std::optional<std::vector<ExpertActivationMax>>> maxima_;
};

}  // namespace nanreplay
