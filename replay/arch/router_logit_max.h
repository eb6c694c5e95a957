// A spike incident's MoE evidence (docs/spikes.md, "What changed"): per layer
// and expert, the largest router logit (the mlp.router site, before the
// softmax) of every pass of a step, over its micro-batches and ranks. The
// mlp.router site's records are of the whole tensor only, so this is taken
// beside them, and only while a RouterLogitRecorder is alive: a replay that
// does not need it pays nothing.
#pragma once

#include <mutex>
#include <vector>

#include <torch/types.h>

namespace nanreplay {

class RouterLogitRecorder {
 public:
  RouterLogitRecorder(int64_t num_layers, int64_t num_experts);  // starts recording
  ~RouterLogitRecorder();                                        // stops
  RouterLogitRecorder(const RouterLogitRecorder&) = delete;
  RouterLogitRecorder& operator=(const RouterLogitRecorder&) = delete;

  // [layer][expert]: -inf where nothing was seen (a layer another process replayed).
  std::vector<std::vector<double>> maxima() const;

  // The router of `layer` computed `logits` (..., E). A no-op when no recorder is alive.
  static void record(int layer, const torch::Tensor& logits);

 private:
  mutable std::mutex mutex_;
  std::vector<std::vector<double>> maxima_;
};

}  // namespace nanreplay
