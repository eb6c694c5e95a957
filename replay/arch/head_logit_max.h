// MuonClip's input (docs/optimizers.md): per layer and query head, the largest
// scaled pre-softmax logit (the attn.scores site before any soft cap, over
// the keys the softmax reads) of every pass of a step, over its micro-batches
// and ranks. Recorded only while a HeadLogitRecorder is alive, so a replay
// that does not need it pays nothing.
#pragma once

#include <mutex>
#include <vector>

#include <torch/types.h>

namespace nanreplay {

class HeadLogitRecorder {
 public:
  // num_layers: every layer with sites (layers_with_sites, probes/sites.h), model.mtp's blocks after
  // the decoder's, each row the layer its sites name.
  HeadLogitRecorder(int64_t num_layers, int64_t num_heads);  // starts recording
  ~HeadLogitRecorder();                                      // stops
  HeadLogitRecorder(const HeadLogitRecorder&) = delete;
  HeadLogitRecorder& operator=(const HeadLogitRecorder&) = delete;

  // [layer][head]: -inf where nothing was seen.
  std::vector<std::vector<double>> maxima() const;

  // The attention of `layer` computed `scores` (B, H, T, T); `hidden` marks
  // the keys its softmax does not read. A no-op when no recorder is alive.
  static void record(int layer, const torch::Tensor& scores, const torch::Tensor& hidden);

 private:
  mutable std::mutex mutex_;
  std::vector<std::vector<double>> maxima_;
};

}  // namespace nanreplay
